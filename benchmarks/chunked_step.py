"""Does a prefill chunk beside decodes cost more than the same tokens apart?

One model-runner step (the default model, the runner's forward + logits, no scheduler) of
  mixed:   N decodes (context --ctx) + one prompt chunk of --chunk tokens after --cached tokens
           of its own context,
  chunk:   the chunk alone,
  decodes: the N decodes alone,
and `mixed - (chunk + decodes)`: what putting them in one step adds (negative: it saves). The
attention share is timed apart: the paged kernel over the same rows and cache, all layers.

    python benchmarks/chunked_step.py [--dtype float32] [--decodes 8,32] [--chunk 256]
                                      [--cached 0,512] [--kv-cache-dtype auto|bfloat16]

Each figure is the best of --reps repeats of the same step (the step is re-sent without advancing,
so it recomputes the same positions).
"""

from __future__ import annotations

import argparse
import time

import torch

from tessera.attention import SeqSpan
from tessera.model.default_model import resolve_model_path
from tessera.model.llama import LlamaForCausalLM
from tessera.model.loader import load_model
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
from tessera.worker.model_runner import ModelRunner
from tessera.worker.static_batch import StaticBatch


def best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def attention_ms(runner, seqs, reps: int) -> float:
    """The paged kernel alone over the step's rows, times the number of layers."""
    spans, positions, row = [], [], 0
    for s in sorted(seqs, key=lambda s: s.num_new_tokens > 1):  # decodes first, as the runner does
        spans.append(SeqSpan(row, s.num_new_tokens, s.num_computed_tokens, s.block_table))
        positions += list(range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens))
        row += s.num_new_tokens
    meta = runner.attn_backend.build_metadata(spans, torch.zeros(row, dtype=torch.long), positions)
    k_cache, v_cache = runner.cache_engine.kv_caches[0]
    cfg, dtype = runner.model.cfg, runner.model.dtype
    q = torch.randn(row, cfg.num_attention_heads, cfg.head_dim).to(dtype)
    k = torch.zeros(row, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    out = torch.empty_like(q)
    ms = best(lambda: meta.attend(q, k, k, k_cache, v_cache, cfg.head_dim**-0.5, out), reps)
    return ms * cfg.num_hidden_layers


@torch.inference_mode()
def measure(runner, batch, dec, chunk, cached: int, chunk_len: int, reps: int):
    """Prefill the decodes' contexts and the chunk's cached part, then time the three steps."""
    n = len(dec)
    batch.logits(dec)
    batch.advance(dec, [1] * n)
    if cached:
        chunk.num_new_tokens = cached
        batch.logits([chunk])
        chunk.num_computed_tokens = cached
    chunk.num_new_tokens = chunk_len
    return (
        best(lambda: batch.logits(dec + [chunk]), reps),
        best(lambda: batch.logits([chunk]), reps),
        best(lambda: batch.logits(dec), reps),
        attention_ms(runner, dec + [chunk], reps),
        attention_ms(runner, [chunk], reps),
        attention_ms(runner, dec, reps),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--decodes", default="8,32")
    ap.add_argument("--ctx", type=int, default=256, help="context of each decode")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument(
        "--cached", default="0,512", help="tokens of the chunk's sequence already cached"
    )
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
    cfg, weights = load_model(resolve_model_path(None), "gguf")
    model = LlamaForCausalLM(cfg, weights, dtype, torch.device("cpu"), 2048)
    del weights
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16, kv_dtype)
    max_decodes = max(int(n) for n in args.decodes.split(","))
    max_cached = max(int(n) for n in args.cached.split(","))
    per_seq = (max(args.ctx + 8, max_cached + args.chunk) + 15) // 16
    cache = CacheEngine(spec, (max_decodes + 2) * per_seq, 0, torch.device("cpu"))
    runner = ModelRunner(model, cache, 16, torch.device("cpu"))
    print(f"dtype {args.dtype}, KV {str(kv_dtype).removeprefix('torch.')}, threads "
          f"{torch.get_num_threads()}, decode context {args.ctx}, chunk {args.chunk}")
    print(f"{'N':>3} {'cached':>6} | {'mixed':>7} {'chunk':>7} {'decodes':>7} {'extra':>7} "
          f"{'extra%':>6} | attn: {'mixed':>6} {'chunk':>6} {'decodes':>7}   (ms)")
    gen = torch.Generator().manual_seed(0)
    for n in (int(x) for x in args.decodes.split(",")):
        for cached in (int(x) for x in args.cached.split(",")):
            batch = StaticBatch(runner, 16)
            dec = [batch.new_seq(torch.randint(100, 49000, (args.ctx,), generator=gen).tolist(),
                                 args.ctx + 8) for _ in range(n)]
            prompt = torch.randint(100, 49000, (cached + args.chunk,), generator=gen).tolist()
            chunk = batch.new_seq(prompt, cached + args.chunk)
            t_mixed, t_chunk, t_dec, a_mixed, a_chunk, a_dec = measure(
                runner, batch, dec, chunk, cached, args.chunk, args.reps)
            extra = t_mixed - t_chunk - t_dec
            print(f"{n:>3} {cached:>6} | {t_mixed:>7.1f} {t_chunk:>7.1f} {t_dec:>7.1f} "
                  f"{extra:>+7.1f} {100 * extra / (t_chunk + t_dec):>+5.1f}% | "
                  f"{a_mixed:>12.1f} {a_chunk:>6.1f} {a_dec:>7.1f}")


if __name__ == "__main__":
    main()
