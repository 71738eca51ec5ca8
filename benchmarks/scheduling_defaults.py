"""The scheduling defaults A/B: chunked prefill + prefix caching off (the old defaults) against on
(vLLM v1's, today's), in one process, alternating, on W1 and on batch-1 decode.

    flock -x /work/cpu.lock .venv/bin/python benchmarks/scheduling_defaults.py \
        [--num-requests 64] [--rounds 1] [--dtype float32]

Both sides use the same token budget (2048: the old default for max_model_len 2048, and the new
default with chunked prefill), so the difference is the two switches alone. W1's prompts are
random token ids: no prefix is shared, so prefix caching can only cost (hashing each full block);
chunked prefill changes how prompts and decodes share a step. Batch-1 decode: one 128-token
prompt, 128 greedy output tokens, output tok/s after the first token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from throughput import workload  # noqa: E402

from tessera import LLM, SamplingParams  # noqa: E402

CONFIGS = {"off (old)": {"enable_chunked_prefill": False, "enable_prefix_caching": False},
           "on (new)": {"enable_chunked_prefill": True, "enable_prefix_caching": True}}


def w1(llm: LLM, prompts, out_lens) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def batch1_decode(llm: LLM, num_tokens: int = 128) -> float:
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1 + num_tokens, temperature=0.0,
                                        ignore_eos=True), use_tqdm=False)
    whole = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return num_tokens / max(whole - (time.perf_counter() - start), 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    prompts, out_lens = workload(args.num_requests)
    llms = {name: LLM(dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=2048,
                       max_model_len=2048, **cfg)
            for name, cfg in CONFIGS.items()}
    for llm in llms.values():  # warm-up: kernels, allocator
        w1(llm, prompts[:2], [4, 4])
    results: dict[str, dict[str, list[float]]] = {n: {"w1": [], "b1": []} for n in CONFIGS}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            results[name]["b1"].append(batch1_decode(llm))
            results[name]["w1"].append(w1(llm, prompts, out_lens))
            print(f"{name}: W1 {results[name]['w1'][-1]:.1f}, batch-1 "
                  f"{results[name]['b1'][-1]:.1f} output tok/s", flush=True)
    print(f"{'chunked prefill + prefix caching':<34}{'W1 output tok/s':>16}"
          f"{'batch-1 decode tok/s':>22}")
    for name, r in results.items():
        print(f"{name:<34}{statistics.median(r['w1']):>16.1f}{statistics.median(r['b1']):>22.1f}")


if __name__ == "__main__":
    main()
