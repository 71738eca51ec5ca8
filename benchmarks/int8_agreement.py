"""Greedy agreement of --quantization gguf_int8 (and gguf) with the dequantized float32 model on
workload W1, and each one's offline output tok/s, in one run.

    flock -x /work/cpu.lock python benchmarks/int8_agreement.py [--quantization gguf_int8,gguf]

Prints, per setting: how many of W1's 64 requests produce exactly the reference's tokens
(`--quantization none`, float32), how many tokens match before the first difference, and tok/s.
"""

from __future__ import annotations

import argparse
import time

from throughput import build_workload  # benchmarks/ is on sys.path when this runs as a script

from tessera import LLM, SamplingParams


def run(quantization: str, prompts, out_lens) -> tuple[list[list[int]], float]:
    llm = LLM(dtype="float32", quantization=quantization, max_num_seqs=64,
              max_num_batched_tokens=2048)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return ids, sum(map(len, ids)) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", default="gguf_int8,gguf")
    ap.add_argument("--workload", default="w1")
    args = ap.parse_args()
    prompts, out_lens = build_workload(args.workload)
    ref, ref_tps = run("none", prompts, out_lens)
    print(f"none (reference): {ref_tps:.1f} output tok/s")
    for q in args.quantization.split(","):
        ids, tps = run(q, prompts, out_lens)
        same = sum(a == b for a, b in zip(ids, ref, strict=True))
        prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y),
                          len(a))
                     for a, b in zip(ids, ref, strict=True))
        total = sum(map(len, ref))
        print(f"{q}: {same}/{len(ref)} requests identical to none ({100 * same / len(ref):.1f}%), "
              f"{prefix}/{total} tokens before the first difference; {tps:.1f} output tok/s")


if __name__ == "__main__":
    main()
