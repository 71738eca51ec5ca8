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

Llama-family layers call `meta.forward_qkv(qkv, num_heads, num_kv_heads, ...)` on the fused
projection's output instead: by default it slices q, k, v and calls `forward`; the paged kernel
takes qkv whole (one C++ call, no head views built in Python).

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
from dataclasses import dataclass, field

import torch

from tessera.attention.spans import SeqSpan, check_spans
from tessera.attention.windowed import WindowedAttention
from tessera.kernels.paged_attention import write_kv
from tessera.sequence import is_decode

__all__ = ["AttentionBackend", "AttentionMetadata", "SeqSpan", "check_spans", "is_decode",
           "write_kv"]

@dataclass
class AttentionMetadata(ABC):
    """One step's attention inputs, built by a backend and shared by every layer.

    `spans` and `block_size` serve the layers the backend's own path does not cover (a sliding
    window, soft-capped scores: tessera/attention/windowed.py), planned once per step and window."""

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    spans: list[SeqSpan] = field(default_factory=list, kw_only=True)
    block_size: int = field(default=16, kw_only=True)
    _windowed: dict[int | None, WindowedAttention] = field(
        default_factory=dict, kw_only=True, repr=False
    )
    # the step's LoRA adapters by row (tessera/lora/mapping.py), set by the runner after the
    # backend built the rest; None: every row runs the base model
    lora_mapping: object | None = field(default=None, init=False)
    # KV cache groups (tessera/core/kv_cache_groups.py): per model layer, the metadata of its
    # group (its block tables and slot mapping), set by the runner; None: one group, this one
    layer_metadata: list[AttentionMetadata] | None = field(default=None, init=False, repr=False)

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata model layer `layer` attends with: its KV cache group's."""
        return self if self.layer_metadata is None else self.layer_metadata[layer]

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write the new K/V into the cache, then attend every query to its sequence's context
        (its cached tokens and the new ones up to itself; only the last `window` of them with a
        sliding window; scores soft-capped as tanh(s / softcap) * softcap). Returns out."""
        write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if out is None:
            out = torch.empty_like(q)
        if window is not None or softcap is not None:
            return self.attend_windowed(q, k_cache, v_cache, scale, out, window, softcap)
        return self.attend(q, k, v, k_cache, v_cache, scale, out)

    def forward_qkv(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] q | k | v
        num_heads: int,
        num_kv_heads: int,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """`forward` on the fused projection's output (RoPE applied): returns
        [num_tokens, num_heads * head_dim]. A backend that can take qkv whole saves the layer
        its slicing into head views (the paged kernel does)."""
        n, head_dim = qkv.shape[0], k_cache.shape[3]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q = qkv[:, :q_size].view(n, num_heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(n, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(n, num_kv_heads, head_dim)
        out = self.forward(q, k, v, k_cache, v_cache, scale, window=window, softcap=softcap)
        return out.view(n, q_size)

    def attend_windowed(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """Attention over each query's window (tessera/attention/windowed.py); K/V are cached."""
        plan = self._windowed.get(window)
        if plan is None:
            plan = WindowedAttention(self.spans, self.block_size, window, q.device)
            self._windowed[window] = plan
        return plan.attend(q, k_cache, v_cache, scale, softcap, out)

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
