"""The C++ paged attention kernel against a plain unpaged reference."""

from __future__ import annotations

import os

import pytest
import torch

from tessera.kernels import build
from tessera.kernels import paged_attention as pa

NATIVE = build.supported_isas()[0]


@pytest.fixture
def kernel(isa):
    """The kernel built for `isa` (conftest.py): every test using it runs once per ISA."""
    if not pa.paged_attention_available(torch.device("cpu"), torch.float32):
        if os.environ.get("TESSERA_DISABLE_CPP_KERNELS"):
            pytest.skip("TESSERA_DISABLE_CPP_KERNELS is set")
        pytest.fail("paged attention C++ kernel did not build for this ISA (see the warning log)")
    return pa._module


def _make_case(num_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype, gen, index_dtype):
    """Random paged cache; each sequence owns distinct random blocks. Returns the kernel's inputs
    and
    each sequence's K/V in order ([L, kvh, D]) for the reference."""
    num_seqs = len(seq_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks no sequence uses
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    # Padding entries point at a block past the cache: the kernel must never read them.
    tables = torch.full((num_seqs, max_blocks), 10**6, dtype=index_dtype)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.long)
    return q, k_cache, v_cache, tables, lens


def _reference(q, k_cache, v_cache, tables, lens, scale):
    """softmax(q k^T) v per sequence over its unpaged context, K/V repeated per query head, fp32."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for b in range(num_seqs):
        n = int(lens[b])
        pos = torch.arange(n)
        blocks = tables[b].long()[pos // block_size]
        k = k_cache[blocks, pos % block_size].float()  # [n, kvh, D]
        v = v_cache[blocks, pos % block_size].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)  # [H, n, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        scores = (q[b].float().unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * scale  # [H, n]
        out[b] = (scores.softmax(-1).unsqueeze(1) @ v).squeeze(1)
    return out


HEADS = [(9, 3), (4, 4), (8, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=[f"h{h}kv{k}" for h, k in HEADS])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference(kernel, dtype, block_size, heads, head_dim, isa):
    if isa != NATIVE and block_size != 16:
        pytest.skip("other block sizes run on the CPU's own ISA only (test time)")
    seed = (
        block_size * 10007 + heads[0] * 101 + heads[1] * 11 + head_dim + (dtype == torch.bfloat16)
    )
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [1, 2, 15, 16, 17, 31, 32, 33, 100, 300] + torch.randint(
        1, 301, (6,), generator=gen
    ).tolist()
    index_dtype = torch.int32 if block_size == 16 else torch.int64
    q, k_cache, v_cache, tables, lens = _make_case(
        *heads, head_dim, block_size, seq_lens, dtype, gen, index_dtype
    )
    scale = head_dim**-0.5
    out = pa.paged_attention(q, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _reference(q, k_cache, v_cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens", [[1000], [129, 5, 700], [128, 256, 384, 1, 513, 90, 64]])
def test_few_rows_spread_by_partition_match_reference(kernel, dtype, seq_lens):
    """Batches too small to balance the threads by rows: each row's 128-token partitions are
    attended apart and folded after; the result is the softmax over the whole context."""
    gen = torch.Generator().manual_seed(len(seq_lens))
    q, k_cache, v_cache, tables, lens = _make_case(9, 3, 64, 16, seq_lens, dtype, gen, torch.int64)
    out = pa.paged_attention(q, k_cache, v_cache, tables, lens, 0.125)
    ref = _reference(q, k_cache, v_cache, tables, lens, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)


def test_strided_q_and_out(kernel):
    """q and out may be row slices of the flat batch (decodes first, prefill tokens after)."""
    gen = torch.Generator().manual_seed(0)
    q, k_cache, v_cache, tables, lens = _make_case(
        9, 3, 64, 16, [5, 40, 77], torch.float32, gen, torch.int64
    )
    q_flat = torch.cat([q, torch.randn(4, 9, 64, generator=gen)])
    out_flat = torch.zeros_like(q_flat)
    pa.paged_attention(q_flat[:3], k_cache, v_cache, tables, lens, 0.125, out=out_flat[:3])
    ref = _reference(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out_flat[:3], ref, atol=1e-5, rtol=0)
    assert out_flat[3:].abs().sum() == 0


def test_generic_head_dim(kernel):
    """head_dim 96 (AVX-512, 6 chunks) and 40 (the portable scalar path)."""
    for head_dim in (96, 40):
        gen = torch.Generator().manual_seed(head_dim)
        q, k_cache, v_cache, tables, lens = _make_case(
            6, 2, head_dim, 16, [1, 33, 120], torch.float32, gen, torch.int64
        )
        out = pa.paged_attention(q, k_cache, v_cache, tables, lens, 0.1)
        ref = _reference(q, k_cache, v_cache, tables, lens, 0.1)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_rejects_block_outside_cache(kernel):
    gen = torch.Generator().manual_seed(1)
    q, k_cache, v_cache, tables, lens = _make_case(
        4, 4, 64, 16, [20, 20], torch.float32, gen, torch.int64
    )
    tables[1, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        pa.paged_attention(q, k_cache, v_cache, tables, lens, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_fallback_matches_reference(dtype):
    """The fallback (no compiler, non-CPU device) computes the same thing."""
    gen = torch.Generator().manual_seed(2)
    q, k_cache, v_cache, tables, lens = _make_case(
        9, 3, 64, 16, [1, 17, 90, 300], dtype, gen, torch.int64
    )
    tables[tables >= k_cache.shape[0]] = 0  # the gather reads padding blocks: keep them valid
    out = torch.empty_like(q)
    pa._torch_fallback(q, k_cache, v_cache, tables, lens, 0.125, out)
    ref = _reference(q, k_cache, v_cache, tables, lens, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)


MIXED = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("dtypes", MIXED, ids=["q32-kv16", "q16-kv32"])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_cache_dtype_differs_from_q(kernel, dtypes, head_dim):
    """--kv-cache-dtype: the cache may be bf16 beside fp32 activations (or the reverse); K/V are
    widened on load, so the result is the fp32 reference on the stored (rounded) K/V."""
    q_dtype, kv_dtype = dtypes
    gen = torch.Generator().manual_seed(head_dim + (q_dtype == torch.float32))
    seq_lens = [1, 15, 16, 17, 33, 100, 257]
    q, k_cache, v_cache, tables, lens = _make_case(
        9, 3, head_dim, 16, seq_lens, kv_dtype, gen, torch.int64
    )
    q = q.to(q_dtype)
    out = pa.paged_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert out.dtype == q_dtype
    ref = _reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)
    tables[tables >= k_cache.shape[0]] = 0  # the fallback gathers padding blocks too
    fb = pa._torch_fallback(q, k_cache, v_cache, tables, lens, head_dim**-0.5, torch.empty_like(q))
    torch.testing.assert_close(fb.float(), ref, atol=tol, rtol=0)


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.bfloat16,) * 2, MIXED[0]])
def test_row_independent_bitwise(kernel, dtypes):
    """A row's result never depends on its batch neighbours, nor on how the rows are split into work
    items (a row's 128-token partitions, or slices of their kv heads, spread over the threads at
    small batches, folded on one thread at large ones): bitwise. Contexts on both sides of the
    partition bounds and past several of them."""
    q_dtype, kv_dtype = dtypes
    gen = torch.Generator().manual_seed(3)
    edges = [1, 127, 128, 129, 256, 257, 1000]
    seq_lens = edges + torch.randint(1, 400, (33,), generator=gen).tolist()
    q, k_cache, v_cache, tables, lens = _make_case(
        9, 3, 64, 16, seq_lens, kv_dtype, gen, torch.int64
    )
    q = q.to(q_dtype)
    batched = pa.paged_attention(q, k_cache, v_cache, tables, lens, 0.125)
    for b in (*range(len(edges)), 20, 39):
        alone = pa.paged_attention(
            q[b : b + 1], k_cache, v_cache, tables[b : b + 1], lens[b : b + 1], 0.125
        )
        assert torch.equal(alone[0], batched[b]), b
    few = pa.paged_attention(q[2:5], k_cache, v_cache, tables[2:5], lens[2:5], 0.125)
    assert torch.equal(few, batched[2:5])


def _new_kv_case(q_dtype, kv_dtype):
    """Sequences whose last token is new: its K/V arrive as strided views of a fused qkv row."""
    gen = torch.Generator().manual_seed(11)
    q, k_cache, v_cache, tables, lens = _make_case(
        9, 3, 64, 16, [1, 17, 40, 300], kv_dtype, gen, torch.int64
    )
    qkv = torch.randn(4, (9 + 2 * 3) * 64, generator=gen).to(q_dtype)
    k = qkv[:, 9 * 64 : 12 * 64].view(4, 3, 64)
    v = qkv[:, 12 * 64 :].view(4, 3, 64)
    last = lens - 1
    slots = tables[torch.arange(4), last // 16] * 16 + last % 16
    return q.to(q_dtype), k, v, k_cache, v_cache, tables, lens, slots


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.bfloat16,) * 2, *MIXED])
def test_new_kv_stored_by_the_same_call(kernel, dtypes):
    """new_kv stores the rows as write_kv does (the cache's dtype, rounded as torch's cast) and the
    attention reads them: bitwise the same as write_kv followed by the kernel."""
    from tessera.attention.backend import write_kv

    q, k, v, k_cache, v_cache, tables, lens, slots = _new_kv_case(*dtypes)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_ref, v_ref, slots)
    expected = pa.paged_attention(q, k_ref, v_ref, tables, lens, 0.125)
    out = pa.paged_attention(q, k_cache, v_cache, tables, lens, 0.125, new_kv=(k, v, slots))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(out, expected)


def test_new_kv_slot_outside_cache_raises(kernel):
    q, k, v, k_cache, v_cache, tables, lens, slots = _new_kv_case(torch.float32, torch.float32)
    slots[2] = k_cache.shape[0] * k_cache.shape[1]
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="slot_mapping"):
        pa.paged_attention(q, k_cache, v_cache, tables, lens, 0.125, new_kv=(k, v, slots))
    assert torch.equal(k_cache, before)  # checked before any row is stored


def test_new_kv_on_the_torch_fallback(monkeypatch):
    """Without the kernel, new_kv is stored by write_kv before the fallback attends."""
    q, k, v, k_cache, v_cache, tables, lens, slots = _new_kv_case(torch.float32, torch.bfloat16)
    tables[tables >= k_cache.shape[0]] = 0  # the gather reads padding blocks: keep them valid
    monkeypatch.setattr(pa, "paged_attention_available", lambda *a: False)
    out = pa.paged_attention(q, k_cache, v_cache, tables, lens, 0.125, new_kv=(k, v, slots))
    assert torch.equal(k_cache.view(-1, 3, 64)[slots], k.to(torch.bfloat16))
    ref = _reference(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def _qkv_case(q_dtype, kv_dtype):
    """_new_kv_case's rows as one fused qkv tensor [4, (9 + 2 * 3) * 64] (q its first 9 heads)."""
    q, k, v, k_cache, v_cache, tables, lens, slots = _new_kv_case(q_dtype, kv_dtype)
    qkv = torch.cat([q.reshape(4, -1), k.reshape(4, -1), v.reshape(4, -1)], dim=1)
    return qkv, k_cache, v_cache, tables, lens, slots


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.bfloat16,) * 2, *MIXED])
def test_qkv_call_equals_sliced_call(kernel, dtypes):
    """paged_attention_qkv on the fused projection's output: the cache and the output bitwise
    those of paged_attention on q, k, v sliced from it, flattened to [T, H D]."""
    qkv, k_cache, v_cache, tables, lens, slots = _qkv_case(*dtypes)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q = qkv[:, : 9 * 64].view(4, 9, 64)
    k, v = qkv[:, 9 * 64 : 12 * 64].view(4, 3, 64), qkv[:, 12 * 64 :].view(4, 3, 64)
    expected = pa.paged_attention(q, k_ref, v_ref, tables, lens, 0.125, new_kv=(k, v, slots))
    fn = pa.qkv_kernel(qkv.device, qkv.dtype, k_cache.dtype)
    assert fn is not None
    out = fn(qkv, 9, 3, k_cache, v_cache, tables, lens, 0.125, slots, None)
    assert out.shape == (4, 9 * 64) and out.dtype == qkv.dtype
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(out, expected.view(4, -1))
    with pytest.raises(RuntimeError, match="qkv width"):
        fn(qkv, 8, 3, k_cache, v_cache, tables, lens, 0.125, slots, None)


def test_qkv_call_on_the_torch_fallback(monkeypatch):
    """Without the kernel, paged_attention_qkv slices and stores through write_kv: the same
    values as the kernel's call, within the fallback's rounding."""
    qkv, k_cache, v_cache, tables, lens, slots = _qkv_case(torch.float32, torch.float32)
    tables[tables >= k_cache.shape[0]] = 0  # the gather reads padding blocks: keep them valid
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = pa.paged_attention_qkv(qkv, 9, 3, k_ref, v_ref, tables, lens, 0.125, slots)
    monkeypatch.setattr(pa, "paged_attention_available", lambda *a: False)
    assert pa.qkv_kernel(qkv.device, qkv.dtype, k_cache.dtype) is None
    out = pa.paged_attention_qkv(qkv, 9, 3, k_cache, v_cache, tables, lens, 0.125, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def _reference_window(q, k_cache, v_cache, tables, lens, starts, scale):
    """_reference over tokens [start, len) of each row: a window's keys only."""
    out = torch.empty(q.shape, dtype=torch.float32)
    bs = k_cache.shape[1]
    for b in range(q.shape[0]):
        s = int(starts[b])
        # a table and length that begin at the window's first token
        pos = torch.arange(s, int(lens[b]))
        blocks = tables[b].long()[pos // bs]
        k = k_cache[blocks, pos % bs].unsqueeze(1)  # [n, 1, kvh, D]: blocks of one token
        v = v_cache[blocks, pos % bs].unsqueeze(1)
        table = torch.arange(len(pos)).unsqueeze(0)
        n = torch.tensor([len(pos)])
        out[b] = _reference(q[b : b + 1], k, v, table, n, scale)[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 40], ids=["by-partition", "by-row"])
def test_sliding_window_starts(kernel, dtype, rows):
    """seq_starts: each row attends to [start, len) only; the blocks before its window are never
    read (their table entries here point outside the cache, as a released block's -1 would)."""
    gen = torch.Generator().manual_seed(rows)
    lens = torch.randint(1, 700, (rows,), generator=gen).tolist()
    q, k_cache, v_cache, tables, lens_t = _make_case(8, 2, 64, 16, lens, dtype, gen, torch.int64)
    windows = torch.randint(1, 300, (rows,), generator=gen)
    starts = (lens_t - windows).clamp(min=0)
    for b in range(rows):
        tables[b, : int(starts[b]) // 16] = -1
    out = pa.paged_attention(q, k_cache, v_cache, tables, lens_t, 0.125, seq_starts=starts)
    ref = _reference_window(q, k_cache, v_cache, tables.clamp(min=0), lens_t, starts, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)
    in_cache = tables.where(tables < k_cache.shape[0], 0)  # the fallback gathers padding too
    fallback = pa._torch_fallback(q, k_cache, v_cache, in_cache, lens_t, 0.125,
                                  torch.empty_like(q), starts)
    torch.testing.assert_close(fallback.float(), ref, atol=tol, rtol=0)


PROMPT_CASES = [((9, 3), 64, 16), ((9, 3), 64, 1), ((4, 4), 128, 32), ((32, 8), 64, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,head_dim,block_size", PROMPT_CASES, ids=[f"h{h}kv{k}-d{d}-bs{b}" for (h, k), d, b in
                                                    PROMPT_CASES]
)
def test_prompt_rows_attended_together(kernel, dtype, heads, head_dim, block_size, isa):
    """A prompt chunk's rows (one table, positions 6..299) after three decodes of other
    sequences, as the runner batches them. On the AMX path consecutive rows sharing a table are
    attended in groups that share every K/V tile: each row must still be bitwise what it is
    alone, also rows whose group straddles a 128-token partition bound, and match the
    reference."""
    if isa != NATIVE and block_size != 16:
        pytest.skip("other block sizes run on the CPU's own ISA only (test time)")
    gen = torch.Generator().manual_seed(head_dim + block_size)
    q, k_cache, v_cache, tables, lens = _make_case(
        *heads, head_dim, block_size, [300, 40, 129, 1], dtype, gen, torch.int64
    )
    positions = torch.arange(6, 300)
    rows_q = torch.cat([q[1:], torch.randn(len(positions), *q.shape[1:], generator=gen).to(dtype)])
    rows_tables = torch.cat([tables[1:], tables[:1].expand(len(positions), -1)]).contiguous()
    rows_lens = torch.cat([lens[1:], positions + 1])
    out = pa.paged_attention(rows_q, k_cache, v_cache, rows_tables, rows_lens, 0.125)
    ref = _reference(rows_q, k_cache, v_cache, rows_tables, rows_lens, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)
    bounds = [3 + p - 6 for p in (6, 7, 125, 126, 127, 128, 129, 130, 255, 256, 299)]
    for b in [0, 1, 2, *bounds, *range(3, len(rows_lens), 17)]:
        alone = pa.paged_attention(
            rows_q[b : b + 1], k_cache, v_cache, rows_tables[b : b + 1], rows_lens[b : b + 1], 0.125
        )
        assert torch.equal(alone[0], out[b]), b
