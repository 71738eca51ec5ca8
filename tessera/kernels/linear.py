"""Linear layers on the CPU: a C++ kernel (linear.cpp) for every row count.

Decode steps multiply a few rows by every weight of the model; they are bound by memory bandwidth
and per-call overhead. Prefill steps are compute-bound. Measured on this machine with
benchmarks/linear.py (30 layers of the default model's four linears, against oneDNN's prepacked
weights in the same run; lower is better):

| rows | fp32 kernel / oneDNN time | bf16 kernel / oneDNN time |
| ---: | ---: | ---: |
| 1 | 0.65 (33 GB/s of weights vs 21) | 0.62 (30 GB/s vs 18) |
| 16 | 0.82 | 0.75 |
| 64 | 0.96 | 0.90 |
| 256 | 1.03 | 1.05 |
| 2048 | 1.07 | ~1.05 |

One kernel for all row counts is also what keeps greedy decoding invariant in bfloat16: each output
is one dot product accumulated in K order, whatever else is in the batch, so a token's result does
not depend on whether its prompt was chunked, batched with others or partly served from the prefix
cache (with oneDNN for large row counts and the kernel for small ones, bf16 greedy outputs differed
between chunked and unchunked runs in 2 of 8 prompts).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from tessera.kernels.build import VEC_HEADER, load_extension
from tessera.kernels.hugepages import in_huge_pages

_SOURCE = Path(__file__).with_name("linear.cpp")
TILES_HEADER = Path(__file__).with_name(
    "linear_tiles.h"
)  # the panel layout, shared with quant_linear
AMX_HEADER = Path(__file__).with_name("linear_amx.h")  # bf16 tiles on AMX, shared with quant_linear
# the avx2/portable tiles (at::vec), shared with quant_linear
GENERIC_HEADER = Path(__file__).with_name("linear_generic.h")


def _module() -> ModuleType | None:
    return load_extension(
        "tessera_linear", _SOURCE, depends=(TILES_HEADER, AMX_HEADER, GENERIC_HEADER, VEC_HEADER)
    )


def linear_kernel_supported(weight: torch.Tensor) -> bool:
    """True when the kernel serves this weight (CPU, fp32 or bf16 with even K; every ISA's
    build)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    module = _module()
    return module is not None and bool(module.available(weight))


def linear_kernel_uses_amx() -> bool:
    """True when bf16 linears run on AMX tiles in this process (linear_amx.h): the CPU has AMX, the
    kernel was built for it, Linux granted the tile state and TESSERA_DISABLE_AMX is unset. AMX
    sums are not the same bits as the vdpbf16ps tiles', so one process uses one or the other."""
    module = _module()
    return module is not None and bool(module.amx_active())


class PackedLinearWeight:
    """A weight [N, K] (and optional bias [N]) packed once into the kernel's panels; callable."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        module = _module()
        assert module is not None, "check linear_kernel_supported first"
        self._linear = module.linear  # looked up once: this is called ~120 times a step
        self.out_features = weight.shape[0]
        self.panels = in_huge_pages(module.pack_weight(weight.contiguous()))
        self.bias = module.pack_bias(bias) if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        return self._linear(x2, self.panels, self.out_features, self.bias).view(
            *lead, self.out_features
        )
