"""Packed weights on transparent huge pages (2 MiB), where Linux allows it.

Why: a decode step streams every weight once, hundreds of MB, and with 4 KiB pages each 4 KiB of
it costs a TLB miss; under a hypervisor the page walk is two-dimensional and costs more still.
Measured on a Sapphire Rapids KVM guest, the random 1B Llama in Q4_0 (`gguf_int8`, 2 threads,
batch 1): 31.1-31.3 tok/s with the weights on 4 KiB pages, 36.2-36.7 with THP on for the whole
system. Most systems default THP to `madvise` (only memory that asks), so the packed weights ask:
a fresh buffer is advised MADV_HUGEPAGE before its first touch, then filled.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_HUGE_PAGE = 2 << 20
# Below this a tensor spans at most a few huge pages: not worth a mapping of its own.
_MIN_BYTES = 4 * _HUGE_PAGE


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` (CPU) copied into an anonymous mapping of its own, advised MADV_HUGEPAGE before the
    copy first touches it; `t` itself where that does not apply (small, another device, not
    Linux). A mapping of its own, because memory from the heap may have been touched already
    (and then keeps its small pages): measured, the advice on torch's own buffer gave 32 tok/s
    of the 36 above. The copy starts on a 2 MiB boundary, so only its last partial page is small.
    The mapping lives as long as the tensor (torch.frombuffer keeps it)."""
    nbytes = t.numel() * t.element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if t.device.type != "cpu" or nbytes < _MIN_BYTES or advice is None or sys.platform != "linux":
        return t
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:
        region.close()
        return t  # THP off ("never") or not built in
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -base % _HUGE_PAGE
    raw = torch.frombuffer(region, dtype=torch.uint8)[offset : offset + nbytes]
    out = raw.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
