"""HF transformers static batching on the same requests that `tessera bench serve` sends.

    python benchmarks/hf_static.py --dataset sharegpt --num-prompts 48 --batch-size 16 \\
        --dtype bfloat16 --result-file docs/results/fig4_hf_static.json

The workload flags are those of `tessera bench serve` (same parser, same `build_samples`, same
tokenizer), so a given `--dataset/--num-prompts/--seed/...` yields the very same prompts and
`max_tokens`. The model is the same GGUF, loaded by `AutoModelForCausalLM.from_pretrained(dir,
gguf_file=...)`.

Static batching: the requests are cut in arrival order into fixed batches of `--batch-size`,
left-padded; each batch is decoded greedily until its longest request is done
(`min_new_tokens = max_new_tokens = max(max_tokens of the batch)`, i.e. no early EOS, as
`--ignore-eos` on the server). Useful tokens are the ones each request asked for; the rest
(tokens past a request's own `max_tokens`) are wasted work and counted separately.

All requests are taken to arrive at t=0 (as `--request-rate inf`): a request's E2E latency is the
time from the start until its batch's `generate` returns (a static batch returns all together).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch


def load_hf_model(model_path: str, dtype: str):
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
            dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    return model.eval()


@torch.inference_mode()
def run_static(model, prompts: list[list[int]], out_lens: list[int], batch_size: int,
               pad_id: int) -> tuple[list[float], list[dict]]:
    """Per-request E2E seconds (from a common t=0) and one record per batch."""
    e2el = [0.0] * len(prompts)
    batches = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, outs = prompts[i:i + batch_size], out_lens[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        n = max(outs)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=pad_id)
        t1 = time.perf_counter()
        assert out.shape[1] == width + n, (out.shape, width, n)
        for j in range(len(batch)):
            e2el[i + j] = t1 - start
        batches.append({"size": len(batch), "padded_prompt_len": width, "new_tokens": n,
                        "useful_tokens": sum(outs), "seconds": t1 - t0})
    return e2el, batches


def main(argv: list[str] | None = None) -> int:
    from tessera.bench.config import add_workload_args
    from tessera.bench.datasets import build_samples
    from tessera.bench.serve import load_bench_tokenizer
    from tessera.model.default_model import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)  # the workload flags of `tessera bench serve` (sending flags ignored)
    ap.add_argument("--hf-model", default=None,
                    help="GGUF file or HF directory (default: the default model)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args(argv)

    tokenizer = load_bench_tokenizer(args.tokenizer)
    samples = build_samples(args, tokenizer)
    # the same text -> ids as the server's /v1/completions (tokenizer.encode of the prompt)
    prompts = [tokenizer.encode(s.prompt) for s in samples]
    out_lens = [s.max_tokens for s in samples]

    model_path = resolve_model_path(args.hf_model)
    model = load_hf_model(model_path, args.dtype)
    pad_id = model.config.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # warm-up (not timed): one tiny batch
    run_static(model, [prompts[0][:8], prompts[0][:4]], [2, 2], 2, pad_id)

    e2el, batches = run_static(model, prompts, out_lens, args.batch_size, pad_id)
    duration = max(e2el)
    useful = sum(out_lens)
    generated = sum(b["size"] * b["new_tokens"] for b in batches)
    ms = np.asarray(e2el) * 1000.0
    metrics = {
        "duration_s": duration, "completed": len(samples),
        "total_input_tokens": sum(len(p) for p in prompts),
        "total_output_tokens": useful, "total_generated_tokens_incl_waste": generated,
        "request_throughput": len(samples) / duration,
        "output_throughput": useful / duration,
        "generated_throughput_incl_waste": generated / duration,
        "mean_e2el_ms": float(ms.mean()), "median_e2el_ms": float(np.median(ms)),
        "p90_e2el_ms": float(np.percentile(ms, 90)), "p99_e2el_ms": float(np.percentile(ms, 99)),
    }
    print(f"HF static batching (batch {args.batch_size}, {args.dtype}): {len(samples)} requests, "
          f"{useful} useful tokens ({generated} generated) in {duration:.1f} s")
    print(f"  useful output tok/s {metrics['output_throughput']:.1f}   "
          f"generated tok/s {metrics['generated_throughput_incl_waste']:.1f}   "
          f"req/s {metrics['request_throughput']:.2f}")
    print(f"  E2E ms: mean {metrics['mean_e2el_ms']:.0f}  median {metrics['median_e2el_ms']:.0f}  "
          f"p99 {metrics['p99_e2el_ms']:.0f}")
    if args.result_file:
        config = {"engine": "hf-transformers-static", "model": os.path.basename(model_path),
                  "dtype": args.dtype, "batch_size": args.batch_size, "dataset": args.dataset,
                  "num_prompts": len(samples), "seed": args.seed,
                  "torch_threads": torch.get_num_threads(), "argv": sys.argv}
        requests = [{"prompt_len": len(p), "output_tokens": n, "e2el": t}
                    for p, n, t in zip(prompts, out_lens, e2el, strict=True)]
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump({"config": config, "metrics": metrics, "batches": batches,
                       "requests": requests}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
