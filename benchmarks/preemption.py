"""Swap against recompute under a cache too small for the batch: which preemption mode should be
the default. Offline (`LLM.generate`, no HTTP), all requests at t=0, greedy, every mode in one run
on the same prompts (the machine is noisy: compare within a run).

    .venv/bin/python benchmarks/preemption.py [--dtype bfloat16] [--num-prompts 32]
        [--input-len 256] [--output-len 256] [--num-gpu-blocks 384]

The default workload is docs/performance.md's figure 2 (32 x 256 in / 256 out, 384 blocks of 16,
--max-num-seqs 64): the requests need 32 x 32 = 1,024 blocks at their longest, so the scheduler
preempts throughout. Measured here (bf16, 2 cores): swap 139.3 vs recompute 113.1 output tok/s
(1.23x), with 18 vs 16 preemptions; so swap is the default (`--preemption-mode` unset).
"""

from __future__ import annotations

import argparse
import random
import time

from tessera import LLM, SamplingParams
from tessera.config import EngineArgs
from tessera.engine.llm_engine import LLMEngine
from tessera.engine.loading import load_bundle


def run(
    bundle, args, mode: str | None, prompts: list[list[int]], ample: bool
) -> tuple[float, float]:
    engine_args = EngineArgs(dtype=args.dtype, max_num_seqs=64, max_model_len=1024,
                             preemption_mode=mode, swap_space=args.swap_space,
                             num_gpu_blocks_override=None if ample else args.num_gpu_blocks)
    llm = LLM.from_engine(LLMEngine.from_engine_args(engine_args, bundle=bundle))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return num_out / elapsed, llm.get_metrics()["tessera:num_preemptions_total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-gpu-blocks", type=int, default=384)
    parser.add_argument("--swap-space", type=float, default=4.0, help="GiB")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    bundle = load_bundle(EngineArgs(dtype=args.dtype, max_model_len=1024))
    print(f"{args.num_prompts} x {args.input_len} in / {args.output_len} out, {args.dtype}, "
          f"{args.num_gpu_blocks} blocks")
    results = {}
    for name, mode in (("swap", "swap"), ("recompute", "recompute")):
        results[name] = run(bundle, args, mode, prompts, ample=False)
        print(
            f"{name:<14} {results[name][0]:8.1f} output tok/s  {results[name][1]:5.0f} preemptions"
        )
    free = run(bundle, args, None, prompts, ample=True)
    print(f"{'no preemption':<14} {free[0]:8.1f} output tok/s  (ample cache)")
    print(f"swap / recompute: {results['swap'][0] / results['recompute'][0]:.2f}x")


if __name__ == "__main__":
    main()
