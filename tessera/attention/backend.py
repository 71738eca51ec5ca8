"""The attention-backend seam: what the runner tells a backend about a step, and what the model's
attention layer calls.

    runner (once per step)                          model (every layer)
    spans, slot_mapping, positions                  q, k, v, this layer's k_cache / v_cache
          │                                                    │
          ▼                                                    ▼
    backend.build_metadata(...) ──▶ AttentionMetadata ──▶ meta.forward(q, k, v, k_cache, v_cache,
    scale)
                                    (an argument of             writes the new K/V at slot_mapping,
                                     model.forward, never       then attends
                                     a global)

The backend is chosen once, at start-up (`select_attention_backend`); per-step metadata (block
tables, masks) is built once per step, not per layer: at batch 1 fixed per-op overhead was ~35% of
a 20 ms bf16 step (DESIGN.md).

Contract on the spans of a step, in flat-batch order: decodes first (`is_decode`: one new token
after a cached context), then prompt chunks (fresh prompts, chunks that continue a cached context,
recompute after a prefix hit). Spans are contiguous: each starts where the previous one ends, and
together they cover every row of the flat batch.

Cache layout per layer: k_cache, v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tessera.kernels.paged_attention import write_kv
from tessera.sequence import is_decode


@dataclass
class SeqSpan:
    """What the runner knows about one scheduled sequence in this step."""

    query_start: int  # first row of this sequence in the flat batch
    num_new_tokens: int  # rows [query_start, query_start + num_new_tokens)
    num_computed_tokens: int  # tokens cached before this step = position of its first new token
    block_table: list[int]  # blocks holding the context and the new tokens

    @property
    def is_decode(self) -> bool:
        return is_decode(self.num_new_tokens, self.num_computed_tokens)

    @property
    def num_tokens(self) -> int:
        """Context length after this step: what its last new token attends to."""
        return self.num_computed_tokens + self.num_new_tokens


def check_spans(spans: list[SeqSpan], num_tokens: int) -> int:
    """Assert the ordering contract (decodes first, contiguous rows covering the batch); returns the
    number of decodes."""
    num_decodes = 0
    while num_decodes < len(spans) and spans[num_decodes].is_decode:
        num_decodes += 1
    row = 0
    for i, span in enumerate(spans):
        assert span.query_start == row, f"span {i} starts at row {span.query_start}, expected {row}"
        assert i < num_decodes or not span.is_decode, f"decode span {i} after a prompt chunk"
        row += span.num_new_tokens
    assert row == num_tokens, f"spans cover {row} rows of {num_tokens}"
    return num_decodes


@dataclass
class AttentionMetadata(ABC):
    """One step's attention inputs, built by a backend and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    ) -> torch.Tensor:
        """Write the new K/V into the cache, then attend every query to its sequence's context
        (its cached tokens and the new ones up to itself). Returns out."""
        write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if out is None:
            out = torch.empty_like(q)
        return self.attend(q, k, v, k_cache, v_cache, scale, out)

    @abstractmethod
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
        """Attention proper; the new K/V are already in the cache (and also passed as k, v)."""


class AttentionBackend(ABC):
    """Builds a step's `AttentionMetadata` for one way of computing attention."""

    name: str

    def __init__(self, device: torch.device, block_size: int):
        self.device = torch.device(device)
        self.block_size = block_size

    @classmethod
    @abstractmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this backend serves caches of this device and dtype."""

    @abstractmethod
    def build_metadata(
        self, spans: list[SeqSpan], slot_mapping: torch.Tensor, positions: list[int]
    ) -> AttentionMetadata:
        """Called once per step. spans: the step's sequences in flat-batch order, decodes first
        (see the module docstring); slot_mapping: [num_tokens] on the device; positions: each
        row's position in its sequence."""
