"""The dtype a checkpoint was stored in, which `--dtype auto` (the default, as in vLLM) runs.

Read from metadata only, before any weight is loaded:
- HF directory: `config.json`'s `torch_dtype` (transformers v4) or `dtype` (v5). bfloat16 and
  float32 run as stored. float16 runs in float32: every fp16 value is exact in fp32, bf16 would
  round away 3 mantissa bits, and fp16 itself has no fast path on CPU (`--dtype half` is refused
  there). A config without the key runs in float32.
- GGUF: float32, the activation type llama.cpp computes in, unless the file stores its float
  weights as BF16 (then bfloat16). Quantized blocks (Q4_1, Q8_0, ...) and F16 tensors convert
  exactly to fp32, so a quantized file gives the same results as `--dtype float32`.
"""

from __future__ import annotations

import json
import os

_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


def checkpoint_dtype(path: str) -> str:
    """The compute dtype `--dtype auto` resolves to for the model at `path` ("float32" or
    "bfloat16"); "float32" when the path is neither an HF directory nor a GGUF file."""
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            return "float32"
        with open(config, encoding="utf-8") as f:
            cfg = json.load(f)
        stored = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return _HF_DTYPES.get(str(stored).removeprefix("torch."), "float32")
    if os.path.isfile(path) and path.endswith(".gguf"):
        import gguf

        reader = gguf.GGUFReader(path, "r")  # memory-mapped: only the tensor headers are read
        bf16 = gguf.GGMLQuantizationType.BF16
        return "bfloat16" if any(t.tensor_type == bf16 for t in reader.tensors) else "float32"
    return "float32"
