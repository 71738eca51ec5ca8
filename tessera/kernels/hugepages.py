"""Packed weights and the KV cache on transparent huge pages (2 MiB), where Linux allows it.

Why: a decode step streams every weight once, hundreds of MB, and with 4 KiB pages each 4 KiB of
it costs a TLB miss; under a hypervisor the page walk is two-dimensional and costs more still.
Measured on a Sapphire Rapids KVM guest, the random 1B Llama in Q4_0 (`gguf_int8`, 2 threads,
batch 1): 31.1-31.3 tok/s with the weights on 4 KiB pages, 36.2-36.7 with THP on for the whole
system. Most systems default THP to `madvise` (only memory that asks), so the packed weights ask:
a fresh buffer is advised MADV_HUGEPAGE before its first touch, then filled. Weights under 8 MiB
share such buffers: on a Zen 4 KVM guest, all linears of a batch-1 decode step (in-process A/B,
2 threads) took 0.96x the time of weights under 8 MiB on the heap for the 1B Llama in Q4_0, and
0.92x for the default 135M model.

The KV cache asks too (`zeros_in_huge_pages`): decode attention reads each sequence's blocks
from anywhere in a pool of GBs, a few KiB a block, so on 4 KiB pages nearly every block read
walks the page tables. Measured on a Zen 4 KVM guest, decode attention at batch 64, context
330, 30 layers of bf16 caches (`benchmarks/attention.py --batch 64 --contexts 330 --dtypes
bfloat16 --layers 30`): 1.08 ms a layer on 4 KiB pages, 0.99-1.00 on huge pages.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
import threading

import torch

_HUGE_PAGE = 2 << 20
# Below this a tensor spans at most a few huge pages: not worth a mapping of its own.
_MIN_BYTES = 4 * _HUGE_PAGE


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` (CPU) copied into anonymous memory advised MADV_HUGEPAGE before the copy first
    touches it; `t` itself where that does not apply (under 64 KiB, another device, not Linux).
    Fresh memory, because memory from the heap may have been touched already (and then keeps its
    small pages): measured, the advice on torch's own buffer gave 32 tok/s of the 36 above.

    A tensor of 8 MiB or more gets a mapping of its own; a smaller one a slice of a shared
    mapping (`_SharedPages`), next to the weights copied before it. Most of a model's weights are
    below 8 MiB (the 1B Llama's qkv, o and down, every linear of a 135M model), and a mapping of
    their own would be mostly partial huge pages."""
    if t.device.type != "cpu":
        return t
    out = _huge_pages_tensor(t.shape, t.dtype)
    if out is None:
        out = _SHARED.take(t.shape, t.dtype)
    if out is None:
        return t
    out.copy_(t)
    return out


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """torch.zeros(shape) on huge pages where that applies (a CPU tensor of at least 8 MiB, on
    Linux with THP not "never"), else torch.zeros itself. The kernel hands out anonymous pages
    zeroed; they are touched here all the same, as torch.zeros does, so that the memory is
    resident from the start and no request's step pays for faulting it in."""
    if device.type == "cpu":
        out = _huge_pages_tensor(shape, dtype)
        if out is not None:
            return out.zero_()
    return torch.zeros(shape, dtype=dtype, device=device)


class _SharedPages:
    """Consecutive slices of shared huge-page mappings of `_CHUNK_BYTES` each, for tensors below
    `_MIN_BYTES`: the weights a model packs one after another lie in the order its step reads
    them. A mapping lives while any slice of it does; only the pages written are resident."""

    _CHUNK_BYTES = 16 * _HUGE_PAGE  # above _MIN_BYTES: a mapping of its own
    _MIN_TAKE = 64 << 10  # below this a tensor spans a few small pages at most: left as is
    _ALIGN = 64  # a cache line

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = math.prod(shape) * dtype.itemsize
        if not self._MIN_TAKE <= nbytes < _MIN_BYTES:
            return None
        with self._lock:
            if self._chunk is None or self._used + nbytes > self._CHUNK_BYTES:
                self._chunk = _huge_pages_tensor((self._CHUNK_BYTES,), torch.uint8)
                self._used = 0
                if self._chunk is None:
                    return None
            start = self._used
            self._used = -(-(start + nbytes) // self._ALIGN) * self._ALIGN
            return self._chunk[start : start + nbytes].view(dtype).view(shape)


_SHARED = _SharedPages()


def _huge_pages_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A CPU tensor of `shape` in an anonymous mapping advised MADV_HUGEPAGE before anything
    touched it (zeros), starting on a 2 MiB boundary so that only its last partial page is small;
    None where that does not apply. The mapping lives as long as the tensor (torch.frombuffer
    keeps it)."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < _MIN_BYTES or advice is None or sys.platform != "linux":
        return None
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:
        region.close()
        return None  # THP off ("never") or not built in
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -base % _HUGE_PAGE
    raw = torch.frombuffer(region, dtype=torch.uint8)[offset : offset + nbytes]
    return raw.view(dtype).view(shape)
