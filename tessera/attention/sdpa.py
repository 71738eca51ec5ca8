"""Attention with torch's `scaled_dot_product_attention`: CUDA, and CPU without the C++ kernel.

Three paths, chosen per sequence when the metadata is built:
- decodes: one padded `scaled_dot_product_attention` for all of them, K/V gathered through the block
  tables with one `index_select` of whole blocks (rows of block_size * kv_heads * head_dim values:
  1.5x faster in fp32 than gathering token slots, measured when this path was written, 13ecdc0);
  GQA folded into the query dimension (q as [B, kv_heads, group, D]), so K/V are never repeated per
  query head (in bf16, `enable_gqa=True` was 2.2x slower than folding, DESIGN.md).
- fresh prefills (nothing cached yet): causal SDPA on the new K/V directly, no gather (87-93% of
  the fp32 matmul peak, DESIGN.md).
- continuing chunks (chunked prefill after the first chunk, recompute after a prefix hit): gather
the
  cached context plus the new tokens and attend with an explicit causal-offset mask.

Decodes must come first in the batch (the backend contract): they are one contiguous slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tessera.attention.backend import AttentionBackend, AttentionMetadata, SeqSpan, check_spans
from tessera.attention.gather import gather_blocks
from tessera.utils import cdiv


@dataclass
class PrefillSpan:
    """Rows [start, end) of the flat batch belong to one prompt chunk with `num_context` cached
    tokens before them. `block_table`/`mask` are set only when num_context > 0."""

    start: int
    end: int
    num_context: int
    block_table: torch.Tensor | None = None  # [num_blocks] blocks holding context + new tokens
    mask: torch.Tensor | None = None  # [n, num_blocks * block_size] bool, True = may attend


@dataclass
class SdpaMetadata(AttentionMetadata):
    num_decodes: int  # rows [0, num_decodes) are decodes, one per sequence
    decode_block_tables: torch.Tensor | None = None  # [num_decodes * max_blocks] flattened, padded
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSpan] = field(default_factory=list)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads

        nd = self.num_decodes
        if nd:
            assert self.decode_block_tables is not None and self.decode_mask is not None
            qd = q[:nd].view(nd, num_kv_heads, group, head_dim)  # [B, kvh, group, D]
            kd = gather_blocks(k_cache, self.decode_block_tables, nd, q.dtype)  # [B, kvh, L, D]
            vd = gather_blocks(v_cache, self.decode_block_tables, nd, q.dtype)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask, scale=scale)
            out[:nd] = od.reshape(nd, num_heads, head_dim)

        for span in self.prefills:
            s, e = span.start, span.end
            qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if span.num_context == 0:
                # rounded as the cache stores them (--kv-cache-dtype), so a token attends to the
                # same K/V whether its prompt came whole or after a cached prefix
                kp = (
                    _as_cached(k[s:e], k_cache, q.dtype).transpose(0, 1).unsqueeze(0)
                )  # [1, kvh, n, D]
                vp = _as_cached(v[s:e], v_cache, q.dtype).transpose(0, 1).unsqueeze(0)
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1
                )
            else:
                assert span.block_table is not None and span.mask is not None
                kp = gather_blocks(k_cache, span.block_table, 1, q.dtype)  # [1, kvh, L, D]
                vp = gather_blocks(v_cache, span.block_table, 1, q.dtype)
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=span.mask, scale=scale, enable_gqa=group > 1
                )
            out[s:e] = op[0].transpose(0, 1)
        return out


def _as_cached(x: torch.Tensor, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to the cache's dtype and back to the compute dtype (no-op when they agree)."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(dtype)


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return True  # plain torch: any device and dtype torch's SDPA takes

    def build_metadata(
        self, spans: list[SeqSpan], slot_mapping: torch.Tensor, positions: list[int]
    ) -> SdpaMetadata:
        num_decodes = check_spans(spans, len(positions))
        meta = SdpaMetadata(
            slot_mapping=slot_mapping,
            num_decodes=num_decodes,
            prefills=[self._prefill_span(s) for s in spans[num_decodes:]],
            spans=spans,
            block_size=self.block_size,
        )
        if num_decodes:
            meta.decode_block_tables, meta.decode_mask = self._decode_tables(spans[:num_decodes])
        return meta

    def _decode_tables(self, decodes: list[SeqSpan]) -> tuple[torch.Tensor, torch.Tensor]:
        """Flattened block tables [B * max_blocks] (padded with block 0) covering each decode's
        whole context, and the padding mask [B, 1, 1, max_blocks * bs]."""
        bs = self.block_size
        lens = [s.num_tokens for s in decodes]
        max_blocks = cdiv(max(lens), bs)
        tables = []
        for s, n in zip(decodes, lens, strict=True):
            used = s.block_table[: cdiv(n, bs)]
            tables.extend(used)
            tables.extend([0] * (max_blocks - len(used)))
        dev = self.device
        tables_t = torch.tensor(tables, dtype=torch.long, device=dev)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        mask = torch.arange(max_blocks * bs, device=dev).unsqueeze(0) < lens_t.unsqueeze(1)
        return tables_t, mask.view(len(decodes), 1, 1, -1)

    def _prefill_span(self, s: SeqSpan) -> PrefillSpan:
        start, end = s.num_computed_tokens, s.num_tokens
        span = PrefillSpan(
            start=s.query_start, end=s.query_start + s.num_new_tokens, num_context=start
        )
        if start > 0:  # continues a cached context: gather it (new tokens included) and mask
            dev = self.device
            blocks = s.block_table[: cdiv(end, self.block_size)]
            span.block_table = torch.tensor(blocks, dtype=torch.long, device=dev)
            q_pos = torch.arange(start, end, device=dev).unsqueeze(1)
            key_pos = torch.arange(len(blocks) * self.block_size, device=dev).unsqueeze(0)
            span.mask = key_pos <= q_pos  # [n, num_blocks * block_size]: causal, and < end
        return span
