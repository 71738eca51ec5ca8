"""Every token of the step through the C++ paged kernel (tessera/kernels/paged_attention.cpp), on
CPU.

Each query row (a decode, or one token of a prompt chunk) attends to the first `position + 1`
tokens of its sequence, read in place through the block table: the length is the causal mask.
Decodes: 3-6x faster than the gather + SDPA of sdpa.py (benchmarks/attention.py). Prompt tokens:
1.15-1.4x faster than causal SDPA (measured when prompt tokens moved onto the kernel, 4f712ac; W1
bf16 293 -> 302 tok/s). And one code path means a token's attention is computed the same way
whether its prompt arrived whole, in chunks, or after a prefix-cache hit: bf16 greedy invariance
(tests/engine/test_bf16_invariance.py) rests on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tessera.attention.backend import AttentionBackend, AttentionMetadata, SeqSpan, check_spans
from tessera.kernels.paged_attention import paged_attention, paged_attention_available, qkv_kernel
from tessera.utils import cdiv


@dataclass
class PagedKernelMetadata(AttentionMetadata):
    token_block_tables: torch.Tensor  # [num_tokens, max_blocks] its sequence's table, padded
    token_seq_lens: torch.Tensor  # [num_tokens] tokens it attends to (position + 1)
    _window_starts: dict[int, torch.Tensor] = field(default_factory=dict, kw_only=True, repr=False)
    # the C++ paged_attention_qkv for this step's tensors, looked up once by the backend (None:
    # forward_qkv slices and goes through forward)
    qkv_kernel: Callable[..., torch.Tensor] | None = field(default=None, kw_only=True, repr=False)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """The new K/V are stored by the attention kernel's own call, not by write_kv first. A
        sliding window is each row's first visible token (the kernel skips what lies before);
        soft-capped scores take the base class's torch path."""
        if softcap is not None:
            return super().forward(q, k, v, k_cache, v_cache, scale, out, window, softcap)
        return paged_attention(
            q, k_cache, v_cache, self.token_block_tables, self.token_seq_lens, scale, out=out,
            new_kv=(k, v, self.slot_mapping), seq_starts=self._starts(window),
        )

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One kernel call on the fused projection's output (the head views are built in C++);
        soft-capped scores take the base class's path."""
        if softcap is None and self.qkv_kernel is not None and qkv.stride(-1) == 1:
            return self.qkv_kernel(
                qkv, num_heads, num_kv_heads, k_cache, v_cache, self.token_block_tables,
                self.token_seq_lens, float(scale), self.slot_mapping, self._starts(window),
            )
        return super().forward_qkv(qkv, num_heads, num_kv_heads, k_cache, v_cache, scale, window,
                                   softcap)

    def _starts(self, window: int | None) -> torch.Tensor | None:
        """[num_tokens] the first key each row sees under `window` (once per step and window)."""
        if window is None:
            return None
        starts = self._window_starts.get(window)
        if starts is None:
            starts = (self.token_seq_lens - window).clamp_(min=0)
            self._window_starts[window] = starts
        return starts

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
        return paged_attention(
            q, k_cache, v_cache, self.token_block_tables, self.token_seq_lens, scale, out=out
        )


class PagedKernelBackend(AttentionBackend):
    name = "paged_kernel"

    def __init__(self, device: torch.device, block_size: int):
        super().__init__(device, block_size)
        # the C++ paged_attention_qkv, looked up once: the build that serves this CPU does not
        # change while the engine runs (the linears keep theirs too); it reads fp32 and bf16
        # activations and caches (every --kv-cache-dtype) and checks them itself
        self._qkv_kernel = qkv_kernel(self.device, torch.float32, torch.float32)

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        # builds the kernel (or loads it from its cache) on the first call: at start-up, not
        # inside the first request
        return paged_attention_available(device, dtype)

    def build_metadata(
        self, spans: list[SeqSpan], slot_mapping: torch.Tensor, positions: list[int]
    ) -> PagedKernelMetadata:
        """Each token's sequence block table [num_tokens, max_blocks] (padded with block 0, never
        read) and how many tokens it attends to [num_tokens] (its position + 1)."""
        check_spans(spans, len(positions))
        bs = self.block_size
        needed = [cdiv(s.num_tokens, bs) for s in spans]
        max_blocks = max(needed)
        per_seq = [
            s.block_table[:n] + [0] * (max_blocks - n) for s, n in zip(spans, needed, strict=True)
        ]
        dev = self.device
        seq_tables = torch.tensor(per_seq, dtype=torch.long, device=dev)
        if all(s.num_new_tokens == 1 for s in spans):  # decodes: a row's table is its sequence's
            token_tables = seq_tables
        else:
            new_tokens = torch.tensor([s.num_new_tokens for s in spans], device=dev)
            of_token = torch.repeat_interleave(torch.arange(len(spans), device=dev), new_tokens)
            token_tables = seq_tables.index_select(0, of_token)
        lens = torch.tensor([p + 1 for p in positions], dtype=torch.long, device=dev)
        return PagedKernelMetadata(
            slot_mapping=slot_mapping,
            token_block_tables=token_tables,
            token_seq_lens=lens,
            spans=spans,
            block_size=bs,
            qkv_kernel=self._qkv_kernel,
        )
