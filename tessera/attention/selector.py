"""`select_attention_backend`: the runner's one choice of backend, made at start-up.

Its own module, above the backends it picks from: in backend.py it made the base class and its
implementations import one another.
"""

from __future__ import annotations

import logging

import torch

from tessera.attention.backend import AttentionBackend
from tessera.attention.paged_kernel import PagedKernelBackend
from tessera.attention.sdpa import SdpaBackend

logger = logging.getLogger(__name__)


def select_attention_backend(
    device: torch.device, dtype: torch.dtype, block_size: int, name: str | None = None
) -> AttentionBackend:
    """The backend for this device and cache dtype, chosen once at start-up: the C++ paged kernel
    where it serves (CPU, float32/bfloat16, built; building it on the first call), else torch SDPA
    (CUDA, and the fallback). `name` ("paged_kernel" or "sdpa") forces one, for tests and
    benchmarks; a forced backend that does not serve this device/dtype is a ValueError."""
    backends: dict[str, type[AttentionBackend]] = {
        b.name: b for b in (PagedKernelBackend, SdpaBackend)
    }
    device = torch.device(device)
    if name is None:
        cls = PagedKernelBackend if PagedKernelBackend.supports(device, dtype) else SdpaBackend
    elif name not in backends:
        raise ValueError(f"unknown attention backend {name!r}: choose one of {sorted(backends)}")
    else:
        cls = backends[name]
        if not cls.supports(device, dtype):
            raise ValueError(
                f"attention backend {name!r} does not serve {device.type}/{dtype}: "
                f"leave it unset to choose automatically"
            )
    logger.info("attention backend: %s (%s, %s)", cls.name, device.type, dtype)
    return cls(device, block_size)
