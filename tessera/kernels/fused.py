"""Fused elementwise ops of a Llama layer (fused.cpp): RMSNorm, residual add + RMSNorm, SiLU*up and
RoPE, one pass and one call each.

Measured with the torch profiler on a batch-64 fp32 decode step of the default model (before this
kernel): RMSNorm ~100 us per call as F.rms_norm's decomposition, SiLU 80 us, the products and adds
another ~25 us each, together ~14 ms of a 156 ms step; at batch 1 the same ops are mostly dispatch.
Every build serves them (AVX-512 by hand; avx2 and portable on at::vec, kernel_vec.h); the torch
versions stay in tessera/model/layers.py for other devices.

`argmax_lse` serves the greedy sampler (tessera/sampling/sampler.py): each float32 logits row's
argmax (torch's first-maximum rule) and logsumexp in two reads of the row, where argmax plus
log_softmax wrote a [rows, vocab] tensor; the sampler was 3.5% of a bf16 batch-64 decode step
before it, 1% after (benchmarks/runner.py --profile).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from tessera.kernels.build import VEC_HEADER, load_extension

_SOURCE = Path(__file__).with_name("fused.cpp")


def fused_ops_for(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The compiled module when it serves tensors of this device and dtype, else None."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    module = load_extension("tessera_fused", _SOURCE, depends=(VEC_HEADER,))
    return module if module is not None and module.available() else None
