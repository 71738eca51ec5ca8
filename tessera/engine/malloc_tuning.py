"""Keep glibc's allocator from holding on to freed memory in a long-lived server process, without
making each step pay for fresh pages.

Why: by default glibc gives each thread that allocates its own arena (the server has the event
loop, the engine thread and torch's OpenMP workers) and raises its mmap threshold each time a big
block is freed, so later big blocks (step buffers, logits, sampler scratch) come from the arenas'
heaps and stay resident after they are freed. Two arenas cap the first. For the second, the server
used a fixed 1 MiB mmap threshold (benchmarks/memory.py, `tessera serve`, W1, 12,288-token fp32 KV
cache: peak RSS 1423 -> 1320 MiB, RSS after W1 1181 -> 1086 MiB). But then every buffer of 1 MiB
or more is a fresh mmap, and its pages fault in (and are zeroed) on first touch, in every layer of
every step: a 2048-token fp32 prefill step took 0.5-0.7 million minor faults and 1.3-1.9x the time
of the same step with the buffers reused (`getrusage` around `engine.step()`, fixed threshold 1 MiB
against 32 MiB). Decode steps, whose buffers are smaller, were not affected.

So the threshold is now glibc's largest (32 MiB on 64-bit: a step's buffers are reused from the
heap) with the trim threshold at twice that, as glibc's own adaptive rule sets it, and the server
gives the heap's free pages back with `release_free_memory` once its engine has been idle for a
second: resident memory comes back down after a burst, and no step waits on page faults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
ARENA_MAX = 2
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere). After
    loading, the file's dequantized float32 copies are freed but stay resident in the heap: on the
    default model after `load_bundle`: 1245 -> 655 MiB with `--quantization none --dtype bfloat16`,
    463 -> 426 MiB with the defaults (quantized weights, float32)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def limit_malloc_retention() -> bool:
    """Apply the settings (before the server starts its threads); False where the C library
    is not glibc, which leaves the defaults. An explicit MALLOC_ARENA_MAX / MALLOC_MMAP_THRESHOLD_
    in the environment is overridden: call this only where the server owns the process."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    ok = all(bool(mallopt(param, value)) for param, value in (
        (_M_ARENA_MAX, ARENA_MAX), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    if not ok:
        logger.debug("mallopt refused the allocator settings; keeping glibc's defaults")
    return ok
