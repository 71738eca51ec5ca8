"""Architecture name -> model class, imported lazily so that loading a config never imports
model code (and the registry can name classes that a neighbour is still writing)."""

from __future__ import annotations

import importlib

# HF architecture name -> "module:Class". Qwen2 is Llama plus bias on q/k/v
# (ModelArchConfig.attention_bias), so both map to one class.
_MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "tessera.model.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "tessera.model.llama:LlamaForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODEL_REGISTRY)


def get_model_class(architecture: str) -> type:
    """The model class for an HF architecture name; ValueError naming the supported ones."""
    target = _MODEL_REGISTRY.get(architecture)
    if target is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
