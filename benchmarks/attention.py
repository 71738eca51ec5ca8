"""Decode attention for one layer: the two attention backends (tessera/attention/) on the same step
of decodes, their metadata built once as the runner does: `sdpa` (gather + padded SDPA) against
`paged_kernel` (the C++ kernel, tessera/kernels/paged_attention.cpp, reading K/V blocks in place).

SmolLM2 geometry by default (9 heads, 3 kv heads, head_dim 64, block size 16); each sequence owns
random blocks of a cache twice the size of the live context, as in a long-running server. Prints
ms/layer for each path, the speedup, and the K/V bytes read once at the kernel's time (GB/s).

    python benchmarks/attention.py [--batch 64] [--contexts 256,512] [--dtypes float32,bfloat16]
                                   [--threads N] [--layers 30]

`--layers N` gives each of N layers its own cache and times a pass over all of them, as a model
step does: with 30 layers the K/V come from DRAM, with one they stay in L3 (the default).
`--tables consecutive` gives each sequence consecutive blocks, as a fresh engine's prompts get;
`--tables shared` puts every row on row 0's blocks, whose K/V stay in L2: the kernel's arithmetic
alone.

A dtype entry may name the cache's dtype after a slash: `float32/bfloat16` is fp32 activations
over a bf16 KV cache (--kv-cache-dtype bfloat16), half the bytes of `float32`.

Timings are the best of three means of --reps calls (wall clock): run it on an otherwise idle
machine; other busy processes on two cores inflate the two-thread numbers erratically.

    python benchmarks/attention.py --baseline REF --batch 1,4,16,64 --contexts 406 [--rounds 5]

    python benchmarks/attention.py --prompt-len 512 [--prompts 4] [--dtypes bfloat16]

`--prompt-len L` times a prefill's attention instead: `--prompts` prompts of L tokens, each row a
position of its prompt (rows of one prompt share its table, as the runner passes a prompt chunk),
the kernel alone, with its GFLOP/s (the causal QK^T and PV products). On a CPU with AMX,
TESSERA_DISABLE_AMX=1 gives the vector path's figure for comparison.

`--baseline REF` builds REF's kernel from a `git worktree` and alternates it with this tree's, in
this process, round by round on the same inputs (the A/B a noisy machine allows): min and median
us per layer of each, their ratio, and whether the outputs are equal. Each case gets enough
layers that the K/V it touches exceed 96 MiB, so every layer reads them from DRAM, as between a
step's layers, where the weights stream through L3.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tessera.attention import SeqSpan, select_attention_backend
from tessera.kernels import paged_attention as pa
from tessera.kernels.build import load_extension
from tessera.kernels.hugepages import in_huge_pages
from tessera.kernels.paged_attention import paged_attention_available
from tessera.utils import cdiv

TABLES = ("random", "consecutive", "shared")


def make_inputs(batch, ctx, num_heads, num_kv_heads, head_dim, block_size, dtype, kv_dtype, gen,
                tables_kind: str = "random"):
    """q, caches, tables and lengths of one decode step. `tables_kind`: each sequence on random
    blocks (a long-running server), on consecutive ones (a fresh engine's prompts), or every row
    on row 0's blocks (`shared`: one sequence's K/V, which stays in L2, so the kernel's arithmetic
    alone)."""
    max_blocks = cdiv(ctx, block_size)
    num_blocks = 2 * batch * max_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # on huge pages, as the engine's KV cache (tessera/kernels/hugepages.py)
    k_cache = in_huge_pages(torch.randn(shape, generator=gen).to(kv_dtype))
    v_cache = in_huge_pages(torch.randn(shape, generator=gen).to(kv_dtype))
    if tables_kind == "random":
        order = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks]
    elif tables_kind == "consecutive":
        order = torch.arange(batch * max_blocks)
    else:  # shared
        order = torch.arange(max_blocks).repeat(batch)
    tables = order.view(batch, max_blocks)
    # Lengths spread over the last block, as decodes of one batch are.
    seq_lens = ctx - torch.randint(0, block_size, (batch,), generator=gen)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables.contiguous(), seq_lens


def decode_metadata(backend_name, tables, seq_lens, block_size, dtype):
    """One decode per sequence (its new token at position seq_len - 1, already in the cache)."""
    spans = [
        SeqSpan(query_start=b, num_new_tokens=1, num_computed_tokens=n - 1, block_table=table)
        for b, (table, n) in enumerate(zip(tables.tolist(), seq_lens.tolist(), strict=True))
    ]
    positions = [s.num_computed_tokens for s in spans]
    slots = torch.tensor([
        s.block_table[p // block_size] * block_size + p % block_size
        for s, p in zip(spans, positions, strict=True)
    ])
    backend = select_attention_backend(torch.device("cpu"), dtype, block_size, name=backend_name)
    return backend.build_metadata(spans, slots, positions)


def time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", default="64", help="rows; with --baseline a list (1,4,64)")
    ap.add_argument("--contexts", default="256,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--heads", default="9,3", help="num_heads,num_kv_heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tables", choices=TABLES, default="random",
                    help="each sequence's blocks: random (a long-running server's), consecutive "
                         "(a fresh engine's), shared (every row row 0's: the arithmetic alone)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--layers", type=int, default=1,
                    help="caches attended in turn, one per layer (30: from DRAM, as in a step)")
    ap.add_argument("--prompt-len", type=int, default=0, help="time a prefill of this length")
    ap.add_argument("--prompts", type=int, default=4, help="with --prompt-len: prompts a call")
    ap.add_argument("--baseline", metavar="REF", help="alternate with REF's kernel in this process")
    ap.add_argument("--rounds", type=int, default=5, help="with --baseline: rounds of each kernel")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    num_heads, num_kv_heads = (int(x) for x in args.heads.split(","))
    t = time.perf_counter()
    have_kernel = paged_attention_available(torch.device("cpu"), torch.float32)
    print(
        f"kernel available: {have_kernel} (load/build {time.perf_counter() - t:.1f} s), "
        f"threads: {torch.get_num_threads()}"
    )
    if not have_kernel:
        raise SystemExit("the paged_kernel backend needs the C++ kernel (see the warning above)")
    if args.baseline:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from peers import baseline_worktree  # benchmarks/peers.py

        with baseline_worktree(args.baseline) as (tree, commit):
            print(f"baseline {args.baseline} = {commit[:10]}; us per layer, min and median of "
                  f"{args.rounds} alternated rounds")
            compare_with_baseline(args, baseline_module(tree), (num_heads, num_kv_heads))
        return
    if args.prompt_len:
        for entry in args.dtypes.split(","):
            bench_prompts(args.prompt_len, args.prompts, (num_heads, num_kv_heads, args.head_dim,
                                                          args.block_size),
                          getattr(torch, entry), args.reps)
        return
    args.batch = int(args.batch)
    print(
        f"B={args.batch} heads={num_heads}/{num_kv_heads} head_dim={args.head_dim} "
        f"block_size={args.block_size}"
    )
    print(f"{'dtype':>16} {'ctx':>5} {'torch ms':>9} {'kernel ms':>10} {'speedup':>8} {'GB/s':>6}")
    gen = torch.Generator().manual_seed(0)
    for entry in args.dtypes.split(","):
        q_name, _, kv_name = entry.partition("/")
        dtype = getattr(torch, q_name)
        kv_dtype = getattr(torch, kv_name) if kv_name else dtype
        for ctx in (int(c) for c in args.contexts.split(",")):
            geometry = (num_heads, num_kv_heads, args.head_dim, args.block_size)
            bench_case(args.batch, ctx, geometry, dtype, kv_dtype, args.reps, gen, args.layers,
                       args.tables)


def bench_case(batch, ctx, geometry, dtype, kv_dtype, reps, gen, layers: int = 1,
               tables_kind: str = "random") -> None:
    """ms per layer of each path, over `layers` caches in turn (one table for all of them)."""
    num_heads, num_kv_heads, head_dim, block_size = geometry
    q, k_cache, v_cache, tables, seq_lens = make_inputs(batch, ctx, *geometry, dtype, kv_dtype, gen,
                                                        tables_kind)
    caches = [(k_cache, v_cache)] + [
        make_inputs(batch, ctx, *geometry, dtype, kv_dtype, gen)[1:3] for _ in range(layers - 1)
    ]
    scale = head_dim**-0.5
    # attend() only: the new K/V count as already written (k, v give the backends their shapes)
    k = v = torch.zeros(batch, num_kv_heads, head_dim, dtype=dtype)
    meta_t = decode_metadata("sdpa", tables, seq_lens, block_size, kv_dtype)
    meta_k = decode_metadata("paged_kernel", tables, seq_lens, block_size, kv_dtype)
    out_t, out_k = torch.empty_like(q), torch.empty_like(q)

    def every_layer(meta, out):
        for kc, vc in caches:
            meta.attend(q, k, v, kc, vc, scale, out)

    ms_t = time_ms(lambda: every_layer(meta_t, out_t), reps) / layers
    ms_k = time_ms(lambda: every_layer(meta_k, out_k), reps) / layers
    diff = (out_t.float() - out_k.float()).abs().max().item()
    kv_bytes = 2 * int(seq_lens.sum()) * num_kv_heads * head_dim * k_cache.element_size()
    name = str(dtype).removeprefix("torch.")
    if kv_dtype != dtype:
        name += "/" + str(kv_dtype).removeprefix("torch.")
    print(
        f"{name:>16} {ctx:>5} {ms_t:>9.3f} {ms_k:>10.3f} {ms_t / ms_k:>7.2f}x "
        f"{kv_bytes / ms_k / 1e6:>6.1f}   (max |diff| {diff:.1e})"
    )


def bench_prompts(length: int, prompts: int, geometry, dtype, reps: int) -> None:
    """ms per call of the kernel on `prompts` whole prompts of `length` tokens, row p of a prompt
    attending to its tokens 0..p."""
    num_heads, num_kv_heads, head_dim, block_size = geometry
    gen = torch.Generator().manual_seed(0)
    q, k_cache, v_cache, tables, _ = make_inputs(prompts, length, *geometry, dtype, dtype, gen)
    rows_q = torch.randn(prompts * length, num_heads, head_dim, generator=gen).to(dtype)
    rows_tables = tables.repeat_interleave(length, dim=0).contiguous()
    rows_lens = torch.arange(1, length + 1).repeat(prompts)
    out = torch.empty_like(rows_q)
    scale = head_dim**-0.5
    ms = time_ms(lambda: pa.paged_attention(rows_q, k_cache, v_cache, rows_tables, rows_lens,
                                            scale, out=out), reps)
    flops = 4 * head_dim * num_heads * int(rows_lens.sum())
    print(f"{str(dtype).removeprefix('torch.'):>9} prefill attention, {prompts} prompts of "
          f"{length}: {ms:.3f} ms, {flops / ms / 1e6:.0f} GFLOP/s")


def baseline_module(tree: str):
    """The paged attention kernel built from another checkout's sources, loaded beside this
    tree's (its own module name, so both stay importable in one process)."""
    kernels = Path(tree) / "tessera" / "kernels"
    headers = sorted(kernels.glob("paged_*.h")) + sorted(kernels.glob("linear_*.h"))
    module = load_extension("tessera_paged_attention_baseline", kernels / "paged_attention.cpp",
                            headers)
    if module is None:
        raise SystemExit(f"the baseline's attention kernel did not build ({kernels})")
    return module


def compare_with_baseline(args, baseline, heads: tuple[int, int]) -> None:
    ours = pa._module
    gen = torch.Generator().manual_seed(0)
    print(f"{'dtype':>16} {'B':>4} {'ctx':>5} {'layers':>6} {'new min':>9} {'median':>8} "
          f"{'base min':>9} {'median':>8} {'min':>7} {'median':>7}  equal")
    for entry in args.dtypes.split(","):
        q_name, _, kv_name = entry.partition("/")
        dtype = getattr(torch, q_name)
        kv_dtype = getattr(torch, kv_name) if kv_name else dtype
        for batch in (int(b) for b in args.batch.split(",")):
            for ctx in (int(c) for c in args.contexts.split(",")):
                geometry = (*heads, args.head_dim, args.block_size)
                touched = 2 * batch * ctx * heads[1] * args.head_dim * kv_dtype.itemsize
                layers = max(args.layers, -(-96 * 2**20 // touched))
                cases = [make_inputs(batch, ctx, *geometry, dtype, kv_dtype, gen, args.tables)
                         for _ in range(layers)]
                reps = max(2, 2000 // layers)

                out = torch.empty_like(cases[0][0])

                def per_layer_us(module, cases=cases, reps=reps, out=out) -> float:
                    t = time.perf_counter()
                    for _ in range(reps):
                        for q, kc, vc, tables, lens in cases:
                            module.paged_attention(q, kc, vc, tables, lens, 0.125, out)
                    return (time.perf_counter() - t) / reps / len(cases) * 1e6

                times: dict[str, list[float]] = {"new": [], "baseline": []}
                for module in (ours, baseline):  # warm-up
                    per_layer_us(module)
                for _ in range(args.rounds):
                    times["new"].append(per_layer_us(ours))
                    times["baseline"].append(per_layer_us(baseline))
                q, kc, vc, tables, lens = cases[0]
                outs = [m.paged_attention(q, kc, vc, tables, lens, 0.125, torch.empty_like(q))
                        for m in (ours, baseline)]
                new, base = min(times["new"]), min(times["baseline"])
                med_new, med_base = (statistics.median(times[k]) for k in ("new", "baseline"))
                print(f"{entry:>16} {batch:>4} {ctx:>5} {layers:>6} {new:>9.1f} {med_new:>8.1f} "
                      f"{base:>9.1f} {med_base:>8.1f} {new / base:>6.3f}x "
                      f"{med_new / med_base:>6.3f}x  {torch.equal(*outs)}", flush=True)


if __name__ == "__main__":
    main()
