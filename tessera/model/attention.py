"""Paged attention over a flat batch of mixed prefill chunks and decodes.

The runner orders a step's sequences as: decodes first (one query token each), then prompt chunks.
`AttentionMetadata` is built once per step and passed to every layer's `forward` (never a global).

On CPU, when the C++ kernel in tessera/kernels is built, every token of the step goes through it:
each query row (a decode or one token of a prompt chunk) attends to the first `position + 1` tokens
of its sequence, read in place through the block table (`token_block_tables`, `token_seq_lens`).
Decodes: 3-6x faster than the gather below (benchmarks/attention.py). Prompt tokens: 1.15-1.4x
faster than causal SDPA, and one code path means a token's attention is computed the same way
whether its prompt arrived whole, in chunks, or after a prefix-cache hit.

Elsewhere (CUDA, or no kernel), three paths, chosen per sequence by the runner:
- decodes: one padded `scaled_dot_product_attention` for all of them, K/V gathered through the block
  tables with one `index_select` of whole blocks (rows of block_size * kv_heads * head_dim values:
  1.5x faster in fp32 than gathering token slots, benchmarks/attention.py); GQA folded into the query
  dimension (q as [B, kv_heads, group, D]), so K/V are never repeated per query head.
- fresh prefills (nothing cached yet): causal SDPA on the new K/V directly, no gather.
- continuing chunks (chunked prefill after the first chunk, recompute after a prefix hit): gather the
  cached context plus the new tokens and attend with an explicit causal-offset mask.

Cache layout per layer: k_cache, v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tessera.kernels.paged_attention import paged_attention as paged_kernel


@dataclass
class PrefillSpan:
    """Tokens [start, end) of the flat batch belong to one sequence with `num_context` cached
    tokens before them. `context_slots`/`mask` are set only when num_context > 0."""

    start: int
    end: int
    num_context: int
    block_table: torch.Tensor | None = None  # [num_blocks] blocks holding context + new tokens
    mask: torch.Tensor | None = None  # [n, num_blocks * block_size] bool, True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    num_decodes: int  # tokens [0, num_decodes) are decodes, one per sequence
    decode_block_tables: torch.Tensor | None = None  # [num_decodes * max_blocks] flattened, padded
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSpan] = field(default_factory=list)
    # set when the C++ kernel serves every token (then the fields above are unused):
    token_block_tables: torch.Tensor | None = None  # [num_tokens, max_blocks] its sequence's table
    token_seq_lens: torch.Tensor | None = None  # [num_tokens] tokens it attends to (position + 1)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store new K/V ([num_tokens, kv_heads, head_dim]) at their flat slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Whole blocks, as [num_seqs, kv_heads, num_blocks * block_size, head_dim] (a strided view)."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = cache.index_select(0, blocks)  # [num_seqs * num_blocks, block_size, kvh, D]
    return gathered.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend every query to its sequence's context."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if out is None:
        out = torch.empty_like(q)

    if meta.token_seq_lens is not None:
        assert meta.token_block_tables is not None
        return paged_kernel(
            q, k_cache, v_cache, meta.token_block_tables, meta.token_seq_lens, scale, out=out
        )

    nd = meta.num_decodes
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)  # [B, kvh, group, D]
        kd = _gather(k_cache, meta.decode_block_tables, nd)  # [B, kvh, L, D]
        vd = _gather(v_cache, meta.decode_block_tables, nd)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, num_heads, head_dim)

    for span in meta.prefills:
        s, e = span.start, span.end
        qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.num_context == 0:
            kp = k[s:e].transpose(0, 1).unsqueeze(0)  # [1, kvh, n, D]
            vp = v[s:e].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            assert span.block_table is not None and span.mask is not None
            kp = _gather(k_cache, span.block_table, 1)  # [1, kvh, L, D]
            vp = _gather(v_cache, span.block_table, 1)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=span.mask, scale=scale, enable_gqa=group > 1
            )
        out[s:e] = op[0].transpose(0, 1)
    return out
