"""Token-bitmask application for structured outputs (token_mask.cpp), with a torch fallback.

Measured (benchmarks/structured_outputs.py): xgrammar's CPU kernel takes ~50 us per 49k-token row
when most tokens are allowed, ~600-800 us when most are masked; the C++ kernel writes -inf with
AVX-512 masked stores, a few microseconds per row either way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.kernels.build import load_extension

_SOURCE = Path(__file__).with_name("token_mask.cpp")
# _BITS[b] = the 8 booleans of byte b, low bit first: unpacks a bitmask with one gather
_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]


def prepare() -> None:
    """Build (or load) the kernel now: a cold build takes 30-90 s, which must not land inside an
    engine step. The grammar backend calls this with its first compile, off the engine thread."""
    load_extension("tessera_token_mask", _SOURCE)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bitmask (bit j of word w: token 32 w + j allowed) -> [R, vocab] bool."""
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # little-endian: low byte first
    return _BITS.to(bitmask.device)[as_bytes].reshape(bitmask.shape[0], -1)[:, :vocab]


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[rows[k]] = -inf where bitmask[rows[k]] forbids; in place (logits [R, V])."""
    if not rows:
        return
    module = None
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1:
        module = load_extension("tessera_token_mask", _SOURCE)
    if module is not None:
        index = torch.tensor(rows, dtype=torch.long)
        module.apply_bitmask_(logits, bitmask.contiguous(), index, index)
        return
    idx = torch.tensor(rows, device=logits.device)
    allowed = unpack_bitmask(bitmask.to(logits.device)[idx], logits.shape[1])
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
