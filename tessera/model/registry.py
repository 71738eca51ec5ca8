"""The supported architectures, in one place: the model class of each (imported lazily, so that
loading a config never imports model code), the other names the loaders accept for it (HF aliases,
GGUF `general.architecture`), and what differs between them. `ModelArchConfig`, the HF loader and
the GGUF loader all ask this module; adding an architecture is an entry here plus its model code.

Torch-free: `tessera/model/config.py` imports it.
"""

from __future__ import annotations

import importlib

# Architecture (HF name, ModelArchConfig.architecture) -> "module:Class". Qwen2 is Llama plus bias
# on q/k/v (ModelArchConfig.attention_bias), so both map to one class.
_MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "tessera.model.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "tessera.model.llama:LlamaForCausalLM",
}

# Architectures with a bias on q/k/v (and none elsewhere).
_QKV_BIAS: frozenset[str] = frozenset({"Qwen2ForCausalLM"})

# Other HF architecture names -> the architecture they load as.
HF_ALIASES: dict[str, str] = {
    "MistralForCausalLM": "LlamaForCausalLM",  # only without a sliding window (hf_loader checks)
}

# GGUF general.architecture -> (architecture, Q/K rows permuted by llama.cpp's converter).
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),  # NEOX-style RoPE in llama.cpp: stored unpermuted
}

# invariant: every alias and GGUF name loads as a registered architecture
assert set(HF_ALIASES.values()) | {a for a, _ in GGUF_ARCHITECTURES.values()} <= set(
    _MODEL_REGISTRY
)
assert set(_MODEL_REGISTRY) >= _QKV_BIAS


def supported_architectures() -> list[str]:
    return sorted(_MODEL_REGISTRY)


def has_qkv_bias(architecture: str) -> bool:
    """Whether the architecture's q/k/v projections carry a bias
    (ModelArchConfig.attention_bias)."""
    return architecture in _QKV_BIAS


def hf_architecture(hf_name: str) -> str | None:
    """The architecture an HF `config.json` name loads as (itself or through an alias); None if
    unsupported."""
    return hf_name if hf_name in _MODEL_REGISTRY else HF_ALIASES.get(hf_name)


def get_model_class(architecture: str) -> type:
    """The model class for an HF architecture name; ValueError naming the supported ones."""
    target = _MODEL_REGISTRY.get(architecture)
    if target is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module_name, _, class_name = target.partition(":")
    cls: type = getattr(importlib.import_module(module_name), class_name)
    return cls
