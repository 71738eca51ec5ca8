"""Decode attention for one layer: the torch gather + SDPA path of model/attention.py against the C++
paged kernel (tessera/kernels/paged_attention.cpp), which reads K/V blocks in place.

SmolLM2 geometry by default (9 heads, 3 kv heads, head_dim 64, block size 16); each sequence owns
random blocks of a cache twice the size of the live context, as in a long-running server. Prints
ms/layer for each path, the speedup, and the K/V bytes read once at the kernel's time (GB/s).

    python benchmarks/attention.py [--batch 64] [--contexts 256,512] [--dtypes float32,bfloat16]
                                   [--threads N]

Timings are the best of three means of --reps calls (wall clock): run it on an otherwise idle
machine; other busy processes on two cores inflate the two-thread numbers erratically.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tessera.kernels.paged_attention import paged_attention, paged_attention_available


def make_inputs(batch, ctx, num_heads, num_kv_heads, head_dim, block_size, dtype, gen):
    max_blocks = -(-ctx // block_size)
    num_blocks = 2 * batch * max_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks)
    # Lengths spread over the last block, as decodes of one batch are.
    seq_lens = ctx - torch.randint(0, block_size, (batch,), generator=gen)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables.contiguous(), seq_lens


def torch_path(q, k_cache, v_cache, flat_blocks, mask, scale, out):
    """model/attention.py's decode branch: index_select whole blocks, GQA folded, one masked SDPA."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    qd = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    kd = k_cache.index_select(0, flat_blocks).view(num_seqs, -1, num_kv_heads, head_dim)
    vd = v_cache.index_select(0, flat_blocks).view(num_seqs, -1, num_kv_heads, head_dim)
    od = F.scaled_dot_product_attention(
        qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=mask, scale=scale
    )
    out[:] = od.reshape(num_seqs, num_heads, head_dim)


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
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", default="256,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--heads", default="9,3", help="num_heads,num_kv_heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
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
    print(
        f"B={args.batch} heads={num_heads}/{num_kv_heads} head_dim={args.head_dim} "
        f"block_size={args.block_size}"
    )
    print(f"{'dtype':>9} {'ctx':>5} {'torch ms':>9} {'kernel ms':>10} {'speedup':>8} {'GB/s':>6}")
    gen = torch.Generator().manual_seed(0)
    for dtype_name in args.dtypes.split(","):
        for ctx in (int(c) for c in args.contexts.split(",")):
            geometry = (num_heads, num_kv_heads, args.head_dim, args.block_size)
            bench_case(args.batch, ctx, geometry, getattr(torch, dtype_name), args.reps, gen)


def bench_case(batch, ctx, geometry, dtype, reps, gen) -> None:
    num_heads, num_kv_heads, head_dim, block_size = geometry
    q, k_cache, v_cache, tables, seq_lens = make_inputs(batch, ctx, *geometry, dtype, gen)
    scale = head_dim**-0.5
    mask = torch.arange(tables.shape[1] * block_size) < seq_lens.unsqueeze(1)
    mask = mask.view(batch, 1, 1, -1)  # as the runner builds it, once per step
    flat = tables.view(-1)
    out_t, out_k = torch.empty_like(q), torch.empty_like(q)
    ms_t = time_ms(lambda: torch_path(q, k_cache, v_cache, flat, mask, scale, out_t), reps)
    ms_k = time_ms(
        lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, scale, out_k), reps
    )
    diff = (out_t.float() - out_k.float()).abs().max().item()
    kv_bytes = 2 * int(seq_lens.sum()) * num_kv_heads * head_dim * q.element_size()
    name = str(dtype).removeprefix("torch.")
    print(
        f"{name:>9} {ctx:>5} {ms_t:>9.3f} {ms_k:>10.3f} {ms_t / ms_k:>7.2f}x "
        f"{kv_bytes / ms_k / 1e6:>6.1f}   (max |diff| {diff:.1e})"
    )


if __name__ == "__main__":
    main()
