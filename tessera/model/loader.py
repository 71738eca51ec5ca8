"""Load a model's architecture and weights from a GGUF file or a Hugging Face directory.

`load_model(path)` is the one entry point. Both formats come back the same way: a
`ModelArchConfig` and a dict of float32 CPU tensors named and laid out as in Hugging Face's
Llama (`model.layers.{i}.self_attn.q_proj.weight`, shape `[out_features, in_features]`), so the
model code never knows which format it came from.
"""

from __future__ import annotations

import logging
import os

import torch

from tessera.distributed.sharding import ShardPlan
from tessera.model.config import ModelArchConfig
from tessera.model.gguf_quant import INTEGER_PATHS, QuantizedTensor

logger = logging.getLogger(__name__)


def load_model(
    path: str, quantization: str = "none", plan: ShardPlan | None = None
) -> tuple[ModelArchConfig, dict[str, torch.Tensor | QuantizedTensor]]:
    """Read config and weights from a `.gguf` file or an HF directory (config.json + safetensors).

    Weights are float32 CPU tensors with HF names; `lm_head.weight` is present only when the
    embeddings are untied. With quantization="gguf" or "gguf_int8", GGUF weights of a type a
    quantized kernel serves come as `QuantizedTensor`s (HF directories have none: the flag
    changes nothing there).
    With a tensor-parallel `plan` (tessera/distributed/sharding.py), every tensor is cut to the
    rank's slice while it is read.
    Raises ValueError for a path that is neither, or an unsupported model.
    """
    path = _check_path(path)
    if path.endswith(".gguf"):
        from tessera.model.gguf_loader import load_gguf

        config, weights = load_gguf(path, quantization, plan)
    else:
        from tessera.model.hf_loader import load_hf_dir

        config, weights = load_hf_dir(path, plan)
    check_weights(config, weights, path, plan)
    return config, weights


def auto_quantization(device: str, path: str | None = None, dtype: str = "float32") -> str:
    """What `--quantization auto` (the default) runs a GGUF on, for a file whose matrices are
    mostly in types the integer path keeps (else, and off the CPU or on the portable build,
    "gguf"; `path` None: the rule for such a file).
    float32: "gguf_int8_a16", whose 16-bit activations keep the dequantized model's greedy tokens
    as the exact kernels do, and which runs faster than them: on the AVX2 build 2-4x their batch-1
    decode, on AVX-512 1.7x on a 1B Q4_K_M file and faster on batches too (W1: 1.5x vLLM-CPU, the
    exact kernels 1.15x).
    bfloat16: "gguf_int8", llama.cpp's 8-bit activations. bf16 already leaves the float model's
    greedy tokens at near-ties (W1: 39 of 64 requests identical even dequantized), and the second
    plane would halve the integer products' rate for little: perplexity 1.0032x the float model's
    against 1.0008x on the exact kernels, W1 1.26x their speed on Zen 4 and 1.22x the two-plane
    path's on AVX2. The exception is a CPU with AMX, whose bf16 tiles run the exact path's
    batches faster than the integer tiles ("gguf": W1 527 against 360 tok/s).
    docs/cpu_kernels.md has the figures."""
    from tessera.kernels.build import cpu_isa

    isa = cpu_isa()
    if torch.device(device).type != "cpu" or isa not in ("avx2", "avx512"):
        return "gguf"
    if path is not None:
        if not path.endswith(".gguf"):
            return "gguf"  # no blocks to keep: nothing changes
        from tessera.model.gguf_loader import integer_path_share

        if integer_path_share(path) < 0.5:
            return "gguf"
    if dtype == "float32":
        return "gguf_int8_a16"
    from tessera.kernels.linear import linear_kernel_uses_amx

    return "gguf" if linear_kernel_uses_amx() else "gguf_int8"


def weight_quantization(
    quantization: str, dtype: str, device: str, path: str | None = None
) -> str:
    """What `load_model` is asked for under `--quantization quantization` with this compute dtype
    and device, for the model at `path`. "auto" is auto_quantization's pick. The integer paths
    ("gguf_int8", "gguf_int8_a16") keep a GGUF's blocks for the integer kernel where it serves (a
    CPU with the C++ kernels built, any ISA), else fall back to "gguf"; "gguf" keeps them where
    the exact kernel serves; elsewhere the weights are dequantized once, at load. Why: without a
    kernel a quantized layer would hold dense weights anyway."""
    from tessera.kernels.quant_linear import int8_kernel_supported, quant_kernel_supported

    torch_dtype, torch_device = getattr(torch, dtype), torch.device(device)
    if quantization == "auto":
        quantization = auto_quantization(device, path, dtype)
        logger.info("--quantization auto: %s on %s", quantization, device)
    if quantization in INTEGER_PATHS:
        if int8_kernel_supported(torch_dtype, torch_device):
            return quantization
        logger.info(
            "--quantization %s: no integer kernel for %s on %s here; trying the exact one",
            quantization,
            dtype,
            device,
        )
        quantization = "gguf"
    if quantization != "gguf":
        return quantization
    if quant_kernel_supported(torch_dtype, torch_device):
        return quantization
    logger.info(
        "--quantization gguf: no quantized kernel for %s on %s here; dequantizing the "
        "weights at load",
        dtype,
        device,
    )
    return "none"


def read_model_config(path: str) -> ModelArchConfig:
    """The architecture of the model at `path`, without reading its weights (the engine's
    process under tensor parallelism needs the shapes, the ranks need the weights)."""
    path = _check_path(path)
    if path.endswith(".gguf"):
        from tessera.model.gguf_loader import read_gguf_config

        return read_gguf_config(path)
    from tessera.model.hf_loader import read_hf_dir_config

    return read_hf_dir_config(path)


def _check_path(path: str) -> str:
    path = os.path.expanduser(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return path
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist")
    else:
        raise ValueError(
            f"model path {path!r} is neither a .gguf file nor a directory with config.json "
            "and *.safetensors"
        )


def check_weights(
    config: ModelArchConfig,
    weights: dict[str, torch.Tensor | QuantizedTensor],
    path: str,
    plan: ShardPlan | None = None,
) -> None:
    """ValueError unless `weights` holds exactly the expected names, with the expected shapes
    (a rank's shapes under a tensor-parallel `plan`)."""
    expected = config.weight_shapes()
    if plan is not None:  # the rank's shapes, and only its experts under expert parallelism
        expected = {name: plan.local_shape(name, shape) for name, shape in expected.items()
                    if plan.holds(name)}
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ValueError(f"{path}: missing weights {missing[:5]} ({len(missing)} in all)")
    extra = [n for n in weights if n not in expected]
    if extra:
        raise ValueError(f"{path}: unexpected weights {extra[:5]} ({len(extra)} in all)")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"{path}: {name} has shape {tuple(weights[name].shape)}, expected {shape}"
            )
