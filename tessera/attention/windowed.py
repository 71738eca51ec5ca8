"""Attention for layers the fused paths do not cover: a sliding window (Mistral, Gemma's local
layers) or tanh soft-capping of the scores (Gemma 2). Plain torch, any device.

A query at position p attends to keys at positions (p - window, p] (all of [0, p] without a
window), HF's rule. Only the blocks that hold such keys are gathered: the blocks a window has left
behind are never read, and may already be freed (their block-table entries are then padding).

Scores are computed in float32 from K/V widened to float32, so the result does not depend on the
batch: each sequence's rows see exactly its own blocks.

    decodes (one row each)        one padded batch: [B, kv_heads, group, window blocks * bs]
    prompt chunks                 per sequence: [kv_heads, group, n, blocks * bs], causal + window
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.attention.gather import gather_blocks
from tessera.attention.spans import SeqSpan
from tessera.utils import cdiv


def first_visible(position: int, window: int | None) -> int:
    """The first key position a query at `position` attends to."""
    return 0 if window is None else max(0, position - window + 1)


@dataclass
class _Chunk:
    start: int  # first row in the flat batch
    end: int
    blocks: torch.Tensor  # [num_blocks] the blocks from the first visible key's on
    mask: torch.Tensor  # [n, num_blocks * block_size] True = may attend


class WindowedAttention:
    """One step's plan for one window size, built once and shared by every layer with that
    window (the tensors depend only on the spans)."""

    def __init__(self, spans: list[SeqSpan], block_size: int, window: int | None,
                 device: torch.device):
        bs = block_size
        self.num_decodes = 0
        while self.num_decodes < len(spans) and spans[self.num_decodes].is_decode:
            self.num_decodes += 1
        decodes, prompts = spans[: self.num_decodes], spans[self.num_decodes :]
        self.decode_blocks: torch.Tensor | None = None
        self.decode_mask: torch.Tensor | None = None
        if decodes:
            firsts = [first_visible(s.num_tokens - 1, window) // bs for s in decodes]
            counts = [cdiv(s.num_tokens, bs) - f for s, f in zip(decodes, firsts, strict=True)]
            width = max(counts)
            table: list[int] = []
            for s, f, c in zip(decodes, firsts, counts, strict=True):
                table += s.block_table[f : f + c] + [s.block_table[f]] * (width - c)
            key_pos = torch.arange(width * bs, device=device).unsqueeze(0) + torch.tensor(
                [f * bs for f in firsts], device=device
            ).unsqueeze(1)  # [B, width * bs]
            lens = torch.tensor([s.num_tokens for s in decodes], device=device).unsqueeze(1)
            lo = torch.tensor([first_visible(s.num_tokens - 1, window) for s in decodes],
                              device=device).unsqueeze(1)
            self.decode_blocks = torch.tensor(table, dtype=torch.long, device=device)
            self.decode_mask = ((key_pos >= lo) & (key_pos < lens)).view(len(decodes), 1, 1, -1)
        self.chunks: list[_Chunk] = []
        for s in prompts:
            first = first_visible(s.num_computed_tokens, window) // bs
            blocks = s.block_table[first : cdiv(s.num_tokens, bs)]
            q_pos = torch.arange(s.num_computed_tokens, s.num_tokens, device=device).unsqueeze(1)
            key_pos = first * bs + torch.arange(len(blocks) * bs, device=device).unsqueeze(0)
            mask = key_pos <= q_pos
            if window is not None:
                mask &= key_pos > q_pos - window
            self.chunks.append(_Chunk(
                s.query_start, s.query_start + s.num_new_tokens,
                torch.tensor(blocks, dtype=torch.long, device=device), mask,
            ))

    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        scale: float,
        softcap: float | None,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    ) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        kvh = k_cache.shape[2]
        group = num_heads // kvh
        nd = self.num_decodes
        if nd:
            assert self.decode_blocks is not None and self.decode_mask is not None
            qd = q[:nd].float().view(nd, kvh, group, head_dim)
            kd = gather_blocks(k_cache, self.decode_blocks, nd, torch.float32)  # [B, kvh, L, D]
            vd = gather_blocks(v_cache, self.decode_blocks, nd, torch.float32)
            od = _softmax_attend(qd, kd, vd, self.decode_mask, scale, softcap)
            out[:nd] = od.reshape(nd, num_heads, head_dim).to(out.dtype)
        for c in self.chunks:
            n = c.end - c.start
            qp = q[c.start : c.end].float().view(n, kvh, group, head_dim).permute(1, 2, 0, 3)
            # [kvh, 1, L, D]
            kp = gather_blocks(k_cache, c.blocks, 1, torch.float32)[0].unsqueeze(1)
            vp = gather_blocks(v_cache, c.blocks, 1, torch.float32)[0].unsqueeze(1)
            op = _softmax_attend(qp, kp, vp, c.mask, scale, softcap)  # [kvh, group, n, D]
            out[c.start : c.end] = op.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim).to(
                out.dtype
            )
        return out


def _softmax_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float, softcap: float | None) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)
