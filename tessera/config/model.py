"""The model's config: which weights, in which dtype and quantization, on which device."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's --dtype spellings; "auto" is the checkpoint's own dtype (tessera/model/checkpoint_dtype.py)
DTYPE_CHOICES = ("auto", "float32", "float", "bfloat16", "half", "float16")
# --quantization: see ModelConfig.quantization; docs/cpu_kernels.md says which runs where
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "gguf_int8", "gguf_int8_a16")
# auto: gguf_int8, gguf_int8_a16 or gguf by CPU, dtype and file (loader.py, auto_quantization)
QUANTIZATION_DEFAULT = "auto"
RESOLVED_DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}


def resolve_dtype(dtype: str, checkpoint_dtype: str | None, device: str) -> str:
    """The compute dtype a `--dtype` value means: "auto" is the checkpoint's dtype (float32 when
    not known yet). float16 is refused on CPU, with the reason; ValueError for an unknown value."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    resolved = (
        (checkpoint_dtype or "float32") if dtype == "auto" else _DTYPE_ALIASES.get(dtype, dtype)
    )
    if resolved == "float16" and device.split(":")[0] == "cpu":
        raise ValueError(
            f"--dtype {dtype} is not supported on CPU: the CPU kernels (linear, attention, fused "
            "norms, quantized GEMV) have float32 and bfloat16 paths only, and this CPU has no fast "
            "fp16 arithmetic. Use --dtype bfloat16 (the same 2 bytes per value) or float32"
        )
    return resolved


@dataclass(frozen=True)
class ModelConfig:
    """What model to run and in which dtype. `max_model_len` is resolved against the model."""

    model: str | None = None
    dtype: str = "float32"
    max_model_len: int = 2048
    seed: int = 0
    # most alternatives per token a request may ask for (logprobs, prompt_logprobs, top_logprobs)
    max_logprobs: int = 20
    # "gguf_int8": a GGUF's weights stay in their blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
    # Q5_K, Q6_K) and run on integer dot products against activations quantized per row to Q8
    # blocks; "gguf": the same blocks with exact float products; "none": all dequantized at load;
    # "auto": for mostly quantized GGUFs on x86 builds, gguf_int8_a16 in fp32 and gguf_int8 in
    # bf16 (gguf on AMX CPUs), else gguf (loader.py, auto_quantization)
    quantization: str = QUANTIZATION_DEFAULT

    def __post_init__(self) -> None:
        if self.dtype not in RESOLVED_DTYPES:
            raise ValueError(f"--dtype must resolve to one of {', '.join(RESOLVED_DTYPES)}, "
                             f"got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be >= 0, got {self.max_logprobs}")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"

    def __post_init__(self) -> None:
        import importlib

        # validate the string without importing torch at module import time
        torch = importlib.import_module("torch")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"--device {self.device!r} is not a valid torch device: {e}") from e
