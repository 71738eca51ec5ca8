"""Offline throughput on workload W1 (64 token-id prompts of 64-512 tokens, each generating exactly
16-256 tokens with ignore_eos) or W2, Tessera against HF transformers static batching in the same
run.

    python benchmarks/throughput.py [--dtype bfloat16] [--num-requests 64] [--skip-hf] [--hf-batch
    16]
    python benchmarks/throughput.py --workload w2 --hf-batch 8,16,32   # W2, HF at each batch size
    python benchmarks/throughput.py --quantization none   # dequantized weights (default: gguf)
    python benchmarks/throughput.py --compare-quantization [--rounds 3]  # W1: quantized vs bf16 vs
    fp32

`--num-requests` above 64 draws W1 again with seeds 1, 2, ... (the first 64 stay W1 itself).
Prints how many requests ran, useful output tok/s for both, the ratio, and where Tessera's step
time goes. `--hf-batch` takes a comma list: HF runs once per batch size and the ratio is taken
against its best one.

W2 (`--workload w2`) is the second random workload: 32 requests of 32-1024 prompt tokens and
32-256 output tokens, seed 1018 (not one of W1's seeds 0, 1, 2, ...). Why those lengths: prompts
up to twice W1's longest put long-context attention and 1k-token prefills into the mix, and the
wide spread of both lengths makes the decode batch shrink step by step from 32 as requests finish,
the mid-size batches that serving runs between prompts (and exactly what a static batch wastes
work on: it pads to the longest prompt and decodes to the longest output of its batch).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch

from tessera import LLM, SamplingParams
from tessera.config import QUANTIZATION_CHOICES

W1_SIZE = 64  # requests in one draw of W1
W2_SIZE = 32  # requests in W2
W2_SEED = 1018  # W1 draws use seeds 0, 1, 2, ...: W2 stays clear of them
WORKLOADS = ("w1", "w2")


def workload(num_requests: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) of `num_requests` requests: draw k of W1 uses seed k, so the first
    64 are always W1 itself and a larger run only adds requests."""
    if num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    prompts: list[list[int]] = []
    out_lens: list[int] = []
    for seed in range(math.ceil(num_requests / W1_SIZE)):
        rng = np.random.default_rng(seed)
        in_lens = rng.integers(64, 513, W1_SIZE)
        out_lens += [int(n) for n in rng.integers(16, 257, W1_SIZE)]
        prompts += [rng.integers(100, 49000, n).tolist() for n in in_lens]
    return prompts[:num_requests], out_lens[:num_requests]


def workload_w2(num_requests: int = W2_SIZE) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) of W2: prompts of 32-1024 random token ids, 32-256 output tokens
    each, from one draw of seed W2_SEED (a smaller `num_requests` takes a prefix of it)."""
    if not 1 <= num_requests <= W2_SIZE:
        raise ValueError(f"--num-requests must be in 1..{W2_SIZE} for w2, got {num_requests}")
    rng = np.random.default_rng(W2_SEED)
    in_lens = rng.integers(32, 1025, W2_SIZE)
    out_lens = [int(n) for n in rng.integers(32, 257, W2_SIZE)]
    prompts = [rng.integers(100, 49000, n).tolist() for n in in_lens]
    return prompts[:num_requests], out_lens[:num_requests]


def build_workload(name: str, num_requests: int | None = None) -> tuple[list[list[int]], list[int]]:
    """The named workload's requests; `num_requests` None means its own size (W1 64, W2 32)."""
    if name == "w1":
        return workload(W1_SIZE if num_requests is None else num_requests)
    if name == "w2":
        return workload_w2(W2_SIZE if num_requests is None else num_requests)
    raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {name!r}")


def parse_batch_sizes(text: str) -> list[int]:
    """`--hf-batch` "8,16,32" -> [8, 16, 32]; ValueError naming the flag for anything else."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--hf-batch must be a comma list of integers, got {text!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"--hf-batch sizes must be >= 1, got {text!r}")
    return sizes


def run_tessera(prompts, out_lens, dtype: str, **engine_args) -> tuple[float, int, LLM]:
    llm = LLM(dtype=dtype, **engine_args)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:2]], params[:2], use_tqdm=False
    )  # warm-up
    llm.llm_engine.step_times.__init__()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), llm


@torch.inference_mode()
def run_hf(prompts, out_lens, dtype: str, batch_size: int) -> tuple[float, int]:
    """Static batching: fixed batches in arrival order, left-padded, each run to its longest
    output."""
    import os

    from transformers import AutoModelForCausalLM

    from tessera.model.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)
    ).eval()
    from hf_static import run_static  # benchmarks/ is on sys.path when this runs as a script

    start = time.perf_counter()
    run_static(model, prompts, out_lens, batch_size, model.config.pad_token_id or 0)
    return time.perf_counter() - start, sum(out_lens)


def compare_quantization(prompts, out_lens, engine_args, rounds: int = 1) -> None:
    """W1 with the GGUF's quantized weights (fp32 and bf16 activations) against the same weights
    dequantized to bf16 and fp32, in one process; output tok/s and the ratio to bf16. The four
    run in turn, `rounds` times, so a slow phase of a noisy machine hits a whole round: each
    figure is the median over rounds, and the ratio is the median of each round's own ratio."""
    configs = [("gguf", "float32"), ("gguf", "bfloat16"), ("none", "bfloat16"), ("none", "float32")]
    results: dict[str, list[float]] = {}
    for r in range(rounds):
        for quantization, dtype in configs:
            elapsed, tokens, llm = run_tessera(
                prompts, out_lens, dtype, quantization=quantization, **engine_args
            )
            name = f"{'q' if quantization == 'gguf' else 'dense'}/{dtype}"
            results.setdefault(name, []).append(tokens / elapsed)
            del llm
        if rounds > 1:
            print(
                f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in results.items()),
                flush=True,
            )
    base = results["dense/bfloat16"]
    for name, tps in results.items():
        ratio = statistics.median(t / b for t, b in zip(tps, base, strict=True))
        print(f"W1 {name:<16}{statistics.median(tps):>8.1f} output tok/s{ratio:>7.2f}x bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--workload", default="w1", choices=WORKLOADS)
    ap.add_argument("--num-requests", type=int, default=None, help="default: the workload's size")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-batch", default="16", help="HF batch size, or a comma list to run each")
    ap.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES)
    ap.add_argument("--compare-quantization", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --compare-quantization: rounds of all four models in turn (medians)")
    args = ap.parse_args()
    prompts, out_lens = build_workload(args.workload, args.num_requests)
    hf_batches = parse_batch_sizes(args.hf_batch)
    num = len(prompts)
    engine_args = {
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    if args.compare_quantization:
        compare_quantization(prompts, out_lens, engine_args, args.rounds)
        return
    elapsed, tokens, llm = run_tessera(
        prompts, out_lens, args.dtype, quantization=args.quantization, **engine_args
    )
    ours = tokens / elapsed
    st = llm.llm_engine.step_times
    print(
        f"tessera  {args.workload} {args.dtype}: {num} requests, {tokens} output tokens in "
        f"{elapsed:.1f}s = "
        f"{ours:.1f} tok/s "
        f"({st.num_steps} steps, {1000 * elapsed / max(st.num_steps, 1):.1f} ms/step)"
    )
    total = st.schedule + st.execute + st.update
    print(
        f"  step time: schedule {100 * st.schedule / total:.1f}%  execute "
        f"{100 * st.execute / total:.1f}%  "
        f"update {100 * st.update / total:.1f}%"
    )
    print(
        f"  execute: {st.num_multi_token_steps} steps with prompt tokens "
        f"{st.multi_token_execute:.2f}s, {st.num_steps - st.num_multi_token_steps} decode steps "
        f"{st.execute - st.multi_token_execute:.2f}s"
    )
    if not args.skip_hf:
        del llm  # HF runs alone
        best = 0.0
        for batch in hf_batches:
            hf_elapsed, hf_tokens = run_hf(prompts, out_lens, args.dtype, batch)
            theirs = hf_tokens / hf_elapsed
            best = max(best, theirs)
            print(f"hf static batching (batch {batch}) {args.dtype}: {num} requests, "
                  f"{hf_tokens} useful tokens in {hf_elapsed:.1f}s = {theirs:.1f} tok/s  "
                  f"(tessera/hf {ours / theirs:.2f}x)", flush=True)
        print(f"ratio tessera/hf: {ours / best:.2f}x"
              + (f" (against HF's best of batch {args.hf_batch})" if len(hf_batches) > 1 else ""))


if __name__ == "__main__":
    main()
