"""Whole KV blocks of a paged cache gathered into one contiguous context per sequence: the plain
torch paths (SDPA, the windowed path) read a block table this way, so both share one layout."""

from __future__ import annotations

import torch


def gather_blocks(
    cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int, dtype: torch.dtype
) -> torch.Tensor:
    """Whole blocks, as [num_seqs, kv_heads, num_blocks * block_size, head_dim] (a strided view),
    in the compute dtype `dtype` (a bf16 cache beside fp32 activations is widened)."""
    _, _, num_kv_heads, head_dim = cache.shape
    # [num_seqs * num_blocks, block_size, kvh, D]
    gathered = cache.index_select(0, blocks).to(dtype)
    return gathered.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
