"""Random GGUF-quantized weights for tests (tests/ is on sys.path, so any test imports this by
name; tests/kernels cannot be imported as `kernels`, which is also an installed package:
transformers requires HF's `kernels`)."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from tessera.model.gguf_quant import QuantizedTensor

T = gguf.GGMLQuantizationType


def random_weight(qtype, n: int, k: int, seed: int = 0, int8: bool = False) -> QuantizedTensor:
    """Random weights in `qtype`'s blocks: quantized by gguf where it can, else random block
    bytes with sane fp16 scales (gguf has no K-quant quantizer). `int8`: packed for the integer
    path (--quantization gguf_int8)."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        raw = gguf.quants.quantize(w, qtype)
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
        for off in (0, 2) if qtype in (T.Q4_K, T.Q5_K) else (208,):
            d = (rng.random((n, k // block, 1)) * 0.002).astype(np.float16)
            raw[..., off : off + 2] = d.view(np.uint8)
        raw = raw.reshape(n, -1)
    return QuantizedTensor(qtype, raw, torch.Size((n, k)), int8)
