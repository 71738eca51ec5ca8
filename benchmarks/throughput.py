"""Offline throughput on workload W1 (64 token-id prompts of 64-512 tokens, each generating exactly
16-256 tokens with ignore_eos), Tessera against HF transformers static batching in the same run.

    python benchmarks/throughput.py [--dtype bfloat16] [--num-requests 64] [--skip-hf] [--hf-batch 16]
    python benchmarks/throughput.py --quantization none   # dequantized weights (default: gguf)
    python benchmarks/throughput.py --compare-quantization   # W1: quantized vs bf16 vs fp32, one run

`--num-requests` above 64 draws W1 again with seeds 1, 2, ... (the first 64 stay W1 itself).
Prints how many requests ran, useful output tok/s for both, the ratio, and where Tessera's step
time goes.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from tessera import LLM, SamplingParams

W1_SIZE = 64  # requests in one draw of W1


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


def run_tessera(prompts, out_lens, dtype: str, **engine_args) -> tuple[float, int, LLM]:
    llm = LLM(dtype=dtype, **engine_args)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params[:2], use_tqdm=False)  # warm-up
    llm.llm_engine.step_times.__init__()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), llm


@torch.inference_mode()
def run_hf(prompts, out_lens, dtype: str, batch_size: int) -> tuple[float, int]:
    """Static batching: fixed batches in arrival order, left-padded, each run to its longest output."""
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


def compare_quantization(prompts, out_lens, engine_args) -> None:
    """W1 with the GGUF's quantized weights (fp32 and bf16 activations) against the same weights
    dequantized to bf16 and fp32, in one process; output tok/s and the ratio to bf16."""
    results = {}
    for quantization, dtype in [("gguf", "float32"), ("gguf", "bfloat16"), ("none", "bfloat16"), ("none", "float32")]:
        elapsed, tokens, llm = run_tessera(prompts, out_lens, dtype, quantization=quantization, **engine_args)
        results[f"{'q' if quantization == 'gguf' else 'dense'}/{dtype}"] = tokens / elapsed
        del llm
    base = results["dense/bfloat16"]
    for name, tps in results.items():
        print(f"W1 {name:<16}{tps:>8.1f} output tok/s{tps / base:>7.2f}x bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--quantization", default="gguf", choices=["none", "gguf"])
    ap.add_argument("--compare-quantization", action="store_true")
    args = ap.parse_args()
    prompts, out_lens = workload(args.num_requests)
    num = len(prompts)
    engine_args = {
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    if args.compare_quantization:
        compare_quantization(prompts, out_lens, engine_args)
        return
    elapsed, tokens, llm = run_tessera(
        prompts, out_lens, args.dtype, quantization=args.quantization, **engine_args
    )
    ours = tokens / elapsed
    st = llm.llm_engine.step_times
    print(f"tessera  {args.dtype}: {num} requests, {tokens} output tokens in {elapsed:.1f}s = "
          f"{ours:.1f} tok/s "
          f"({st.num_steps} steps, {1000 * elapsed / max(st.num_steps, 1):.1f} ms/step)")
    total = st.schedule + st.execute + st.update
    print(f"  step time: schedule {100 * st.schedule / total:.1f}%  execute {100 * st.execute / total:.1f}%  "
          f"update {100 * st.update / total:.1f}%")
    if not args.skip_hf:
        hf_elapsed, hf_tokens = run_hf(prompts, out_lens, args.dtype, args.hf_batch)
        theirs = hf_tokens / hf_elapsed
        print(f"hf static batching (batch {args.hf_batch}) {args.dtype}: {num} requests, "
              f"{hf_tokens} useful tokens in "
              f"{hf_elapsed:.1f}s = {theirs:.1f} tok/s")
        print(f"ratio tessera/hf: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
