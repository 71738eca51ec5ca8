"""Paged attention against plain SDPA on the same unpaged K/V: random block tables, mixed query and
context lengths (decodes, fresh prefills, continuing chunks in one batch), block sizes 1, 16, 32."""

import random

import pytest
import torch
import torch.nn.functional as F

from tessera.kernels.paged_attention import paged_attention_available
from tessera.model.attention import AttentionMetadata, PrefillSpan, paged_attention


def _reference(q, k, v, num_context):
    """q: [n, H, D] for the last n positions of a sequence whose full K/V is k, v: [L, kvh, D]."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    length = k.shape[0]
    mask = torch.arange(length).unsqueeze(0) <= (num_context + torch.arange(n)).unsqueeze(1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kernel", [False, True], ids=["gather-sdpa", "cpp-kernel"])
def test_paged_attention_matches_sdpa(block_size, seed, kernel):
    if kernel and not paged_attention_available(torch.device("cpu"), torch.float32):
        pytest.skip("C++ paged-attention kernel could not be built here")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads, num_kv_heads, head_dim = 6, 2, 16
    # (num_context, num_new): decodes, fresh prefills, continuing chunks
    decodes = [(rng.randint(1, 70), 1) for _ in range(4)]
    prefills = [(0, rng.randint(1, 40)), (rng.randint(1, 50), rng.randint(2, 30)), (0, 1)]
    shapes = decodes + prefills
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 3
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)

    qs, ks, vs, full_k, full_v, slots_all, tables = [], [], [], [], [], [], []
    for num_context, num_new in shapes:
        length = num_context + num_new
        table = [free.pop() for _ in range(-(-length // block_size))]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        kf = torch.randn(length, num_kv_heads, head_dim)
        vf = torch.randn(length, num_kv_heads, head_dim)
        # the context is already in the cache; the new tokens arrive with the batch
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        flat_k[slots[:num_context]] = kf[:num_context]
        flat_v[slots[:num_context]] = vf[:num_context]
        qs.append(torch.randn(num_new, num_heads, head_dim))
        ks.append(kf[num_context:])
        vs.append(vf[num_context:])
        full_k.append(kf)
        full_v.append(vf)
        slots_all.append(slots)
        tables.append(table)

    nd = len(decodes)
    max_blocks = max(len(t) for t in tables[:nd])
    decode_tables = torch.tensor([b for t in tables[:nd] for b in t + [0] * (max_blocks - len(t))])
    max_len = max_blocks * block_size
    decode_mask = (torch.arange(max_len).unsqueeze(0) < torch.tensor([c + 1 for c, _ in decodes]).unsqueeze(1))
    spans, offset = [], nd
    for i in range(nd, len(shapes)):
        num_context, num_new = shapes[i]
        span = PrefillSpan(offset, offset + num_new, num_context)
        if num_context:
            span.block_table = torch.tensor(tables[i])
            span.mask = torch.arange(len(tables[i]) * block_size).unsqueeze(0) <= (
                num_context + torch.arange(num_new)
            ).unsqueeze(1)
        spans.append(span)
        offset += num_new
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([s for (c, _), sl in zip(shapes, slots_all, strict=False) for s in sl[c:]]),
        num_decodes=nd,
    )
    if kernel:  # every token through the kernel: its sequence's table, position + 1 tokens
        width = max(len(t) for t in tables)
        rows, lens = [], []
        for (num_context, num_new), table in zip(shapes, tables, strict=True):
            for p in range(num_context, num_context + num_new):
                rows.append(table + [0] * (width - len(table)))
                lens.append(p + 1)
        meta.token_block_tables, meta.token_seq_lens = torch.tensor(rows), torch.tensor(lens)
    else:
        meta.decode_block_tables = decode_tables
        meta.decode_mask = decode_mask.view(nd, 1, 1, max_len)
        meta.prefills = spans
    out = paged_attention(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, scale=head_dim**-0.5
    )
    expected = torch.cat(
        [_reference(q, kf, vf, c) for q, kf, vf, (c, _) in zip(qs, full_k, full_v, shapes, strict=False)]
    )
    assert (out - expected).abs().max().item() <= 1e-5
