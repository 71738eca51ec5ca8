"""Greedy agreement of --quantization gguf_int8 (and gguf) with the dequantized float32 model on
workload W1, and each one's offline output tok/s, in one run.

    flock -x /work/cpu.lock python benchmarks/int8_agreement.py [--quantization gguf_int8,gguf]
    flock -x /work/cpu.lock python benchmarks/int8_agreement.py --teacher-forced
    python benchmarks/int8_agreement.py --teacher-forced --llama-cpp [--build-dir DIR]

Prints, per setting: how many of W1's 64 requests produce exactly the reference's tokens
(`--quantization none`, float32), how many tokens match before the first difference, and tok/s.

`--llama-cpp`: also llama.cpp's greedy output on the same GGUF and token ids against the same
reference: what agreement llama.cpp's own integer form reaches (llama-server from
benchmarks/llamacpp_peer.py's build, one slot, fp32 KV cache, flash attention off, weight
repacking off, greedy with ignore_eos; 127.0.0.1 only, stopped at the end).

`--teacher-forced`: the reference generates once, with its top-2 logprobs; each setting then
scores the reference's own tokens, one prefill a request, and its first argmax that differs is
where its greedy output leaves the reference. Exact, since a row's result depends neither on its
batch nor on chunking on either quantized path, and ~4x cheaper than generating again. Prints
also where each request first differs and the reference's top-2 logprob gap there (a near-tie or
not).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import torch
from prompt_scorer import PromptScorer  # benchmarks/ is on sys.path as a script
from throughput import build_workload

from tessera import LLM, SamplingParams


def run(quantization: str, prompts, out_lens, logprobs: int | None = None,
        dtype: str = "float32"):
    """(token ids per request, output tok/s, top-2 logprob gap at each output position)."""
    llm = LLM(dtype=dtype, quantization=quantization, max_num_seqs=64,
              max_num_batched_tokens=2048)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
              for n in out_lens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    gaps = []
    for o in outs:
        top2 = [sorted(lp.values(), reverse=True)[:2] for lp in (o.outputs[0].logprobs or [])]
        gaps.append([t[0] - t[1] if len(t) > 1 else float("inf") for t in top2])
    return ids, sum(map(len, ids)) / elapsed, gaps


@torch.inference_mode()
def first_differences(quantization: str, prompts, ref_ids,
                      dtype: str = "float32") -> list[int | None]:
    """Per request: the first output position where this setting's argmax, fed the reference's
    tokens, differs from the reference's token (None: never)."""
    from tessera.model.default_model import resolve_model_path

    n = max(len(p) + len(r) for p, r in zip(prompts, ref_ids, strict=True))
    scorer = PromptScorer(resolve_model_path(None), quantization, dtype, n)
    firsts: list[int | None] = []
    for p, r in zip(prompts, ref_ids, strict=True):
        top = scorer(p + r[:-1])[len(p) - 1 :].argmax(-1).tolist()
        firsts.append(next((i for i, (a, b) in enumerate(zip(top, r, strict=True)) if a != b),
                           None))
    return firsts


@contextlib.contextmanager
def llama_server(build_dir: str, model: str, threads: int) -> Iterator[str]:
    """A llama-server on a free 127.0.0.1 port for the duration; yields its base URL."""
    from llamacpp_build import llama_bench_path

    server = os.path.join(os.path.dirname(llama_bench_path(build_dir)), "llama-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-np", "1", "-c", "2048", "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--no-repack"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health",
                                                                      timeout=2) as r:
                if r.status == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {cmd}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_llama_cpp(build_dir: str, prompts, out_lens, threads: int) -> list[list[int]]:
    """llama.cpp's greedy tokens for each request, one at a time."""
    from tessera.model.default_model import resolve_model_path

    ids = []
    with llama_server(build_dir, resolve_model_path(None), threads) as url:
        for p, n in zip(prompts, out_lens, strict=True):
            body = {"prompt": p, "n_predict": n, "temperature": 0.0, "top_k": 1,
                    "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
            req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                ids.append(list(json.loads(r.read())["tokens"]))
    return ids


def agreement(ids, ref) -> tuple[int, int]:
    """(requests identical to the reference, tokens before each request's first difference)."""
    same = sum(a == b for a, b in zip(ids, ref, strict=True))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                      min(len(a), len(b)))
                 for a, b in zip(ids, ref, strict=True))
    return same, prefix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", default="gguf_int8,gguf")
    ap.add_argument("--workload", default="w1")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the measured settings' compute dtype (the reference stays float32)")
    ap.add_argument("--teacher-forced", action="store_true",
                    help="score the reference's tokens instead of generating again")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also llama.cpp's greedy output on the same GGUF against the reference")
    ap.add_argument("--build-dir", default=None, help="llama.cpp build (llamacpp_peer.py's)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    prompts, out_lens = build_workload(args.workload)
    ref, ref_tps, gaps = run("none", prompts, out_lens, 2 if args.teacher_forced else None)
    print(f"none (reference): {ref_tps:.1f} output tok/s")
    total = sum(map(len, ref))
    for q in args.quantization.split(","):
        if args.teacher_forced:
            firsts = first_differences(q, prompts, ref, args.dtype)
            same = sum(f is None for f in firsts)
            prefix = sum(len(r) if f is None else f for f, r in zip(firsts, ref, strict=True))
            print(f"{q} {args.dtype}: {same}/{len(ref)} requests identical to none, "
                  f"{prefix}/{total} tokens "
                  "before the first difference")
            at = sorted((f, round(gaps[i][f], 3)) for i, f in enumerate(firsts) if f is not None)
            print(f"  (first difference, reference's top-2 logprob gap there): {at}")
            continue
        ids, tps, _ = run(q, prompts, out_lens, dtype=args.dtype)
        same, prefix = agreement(ids, ref)
        print(f"{q} {args.dtype}: {same}/{len(ref)} requests identical to none "
              f"({100 * same / len(ref):.1f}%), "
              f"{prefix}/{total} tokens before the first difference; {tps:.1f} output tok/s")
    if args.llama_cpp:
        from llamacpp_build import DEFAULT_BUILD_DIR

        start = time.perf_counter()
        ids = run_llama_cpp(args.build_dir or DEFAULT_BUILD_DIR, prompts, out_lens, args.threads)
        same, prefix = agreement(ids, ref)
        print(f"llama.cpp: {same}/{len(ref)} requests identical to none "
              f"({100 * same / len(ref):.1f}%), {prefix}/{total} tokens before the first "
              f"difference ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
