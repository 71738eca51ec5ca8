"""Small-batch linear layers on the CPU: a C++ kernel (linear.cpp) that streams each weight once.

Decode steps multiply a few rows by every weight of the model; they are bound by memory bandwidth
and per-call overhead. Measured on this machine (30 layers of the default model's four linears,
benchmarks/runner.py has the end-to-end effect): at M=1 the kernel reads fp32 weights at ~31 GB/s
(oneDNN's packed GEMV ~20 GB/s, the memory system ~33), and it stays ahead of oneDNN up to about
96 rows in both fp32 and bf16. Past that oneDNN's GEMM is 5-15% faster, so `Linear` in
tessera/model/layers.py routes by row count (`SMALL_BATCH_MAX_ROWS`).

A row's result never depends on the other rows of the call (each output is one dot product in K
order), so batching does not perturb decode results inside this kernel.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from tessera.kernels.build import load_extension

SMALL_BATCH_MAX_ROWS = 96
_SOURCE = Path(__file__).with_name("linear.cpp")


def _module() -> ModuleType | None:
    return load_extension("tessera_linear", _SOURCE)


def small_batch_linear_supported(weight: torch.Tensor) -> bool:
    """True when the kernel serves this weight (CPU, fp32 or bf16 with even K, AVX-512 build)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    module = _module()
    return module is not None and bool(module.available(weight))


class PackedLinearWeight:
    """A weight [N, K] (and optional bias [N]) packed once for `small_batch_linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        module = _module()
        assert module is not None, "check small_batch_linear_supported first"
        self.out_features = weight.shape[0]
        self.panels = module.pack_weight(weight.contiguous())
        self.bias = module.pack_bias(bias) if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        module = _module()
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = module.linear(x2, self.panels, self.out_features, self.bias)
        return y.view(*lead, self.out_features)
