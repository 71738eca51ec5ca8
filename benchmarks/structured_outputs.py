"""What structured outputs cost: the grammar mask per constrained row, grammar compilation (first
use and cached), and decode tok/s of a batch with schemas against the same batch without, in the
same run.

    python benchmarks/structured_outputs.py [--dtype float32] [--batch 16] [--max-tokens 128]

Both batches generate exactly `--max-tokens` tokens per request (ignore_eos): the schema is an
unbounded array, so every step of every constrained row is masked. Target: constrained decode
within 10% of unconstrained at batch 16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tessera import LLM, SamplingParams
from tessera.sampling.grammar import GrammarBackend, apply_grammar_masks

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"]}}


def time_masks(llm: LLM, rows: int, repeats: int = 50) -> float:
    """µs per constrained row of fill + apply, on [rows, vocab] logits, mid-grammar."""
    engine = llm.llm_engine
    backend = engine.grammar_backend
    from tessera.sampling.structured_outputs import StructuredOutputsParams

    params = StructuredOutputsParams(json=SCHEMA)
    prefix = engine.tokenizer.encode('[{"name": "Ann", "age": 3', add_special_tokens=False)
    states = [backend.matcher(params, prefix) for _ in range(rows)]
    logits = torch.randn(rows, engine.vocab_size)
    samples = []
    for _ in range(repeats):
        work = logits.clone()
        start = time.perf_counter()
        apply_grammar_masks(work, states, engine.eos_token_ids)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) / rows * 1e6


def time_compile(llm: LLM) -> tuple[float, float]:
    """ms to compile a fresh schema (new backend, nothing cached), then the same one cached."""
    engine = llm.llm_engine
    from tessera.sampling.structured_outputs import StructuredOutputsParams

    backend = GrammarBackend(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    backend.compile(StructuredOutputsParams(regex="warm"))  # tokenizer info, once per backend
    params = StructuredOutputsParams(json=SCHEMA)
    start = time.perf_counter()
    backend.compile(params)
    first = time.perf_counter() - start
    start = time.perf_counter()
    backend.compile(params)
    cached = time.perf_counter() - start
    return first * 1e3, cached * 1e3


def decode_tok_s(llm: LLM, prompts, params) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each kind")
    args = ap.parse_args()

    llm = LLM(dtype=args.dtype)
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": engine.apply_chat_template([{
        "role": "user", "content": f"List {i + 2} people with their ages as JSON."}])}
        for i in range(args.batch)]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                 structured_outputs={"json": SCHEMA})
    decode_tok_s(llm, prompts[:2], [free, constrained])  # warm-up (kernels, xgrammar import)

    first_ms, cached_ms = time_compile(llm)
    print(f"compile: first use {first_ms:.2f} ms, cached {cached_ms * 1e3:.1f} us")
    for rows in (1, args.batch):
        print(f"mask (fill + apply), {rows} rows: {time_masks(llm, rows):.0f} us per row")

    runs: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    for _ in range(args.rounds):  # alternate, so drift hits both alike
        runs["unconstrained"].append(decode_tok_s(llm, prompts, free))
        runs["constrained"].append(decode_tok_s(llm, prompts, constrained))
    best = {k: max(v) for k, v in runs.items()}
    print(f"batch {args.batch}, {args.max_tokens} tokens each, {args.dtype}:")
    for kind, values in runs.items():
        print(f"  {kind:14s} {best[kind]:7.1f} out tok/s (runs: "
              f"{', '.join(f'{v:.1f}' for v in values)})")
    ratio = best["constrained"] / best["unconstrained"]
    print(f"constrained / unconstrained = {ratio:.3f} (target >= 0.90)")
    print(json.dumps({"compile_first_ms": first_ms, "compile_cached_ms": cached_ms,
                      "ratio": ratio, **best}))


if __name__ == "__main__":
    main()
