"""The supported architectures, in one place: the model class of each (imported lazily, so that
loading a config never imports model code), the other names the loaders accept for it (HF aliases,
GGUF `general.architecture`), and how each family differs from Llama (`ArchTraits`).
`ModelArchConfig`, the HF loader, the GGUF loader and the model code all ask this module; adding
a family is an entry here, the config fields its `config.json` adds (tessera/model/config.py) and
its loader names, never a copy of the model.

Torch-free: `tessera/model/config.py` imports it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from tessera.utils import QK_NORM_OVER_ALL_HEADS


@dataclass(frozen=True)
class ArchTraits:
    """What a family changes in the one decoder (tessera/model/llama.py). Numbers that vary by
    checkpoint (windows, soft-caps, RoPE) live in `ModelArchConfig`; these are fixed by family.

    qkv_bias:        bias on q/k/v only (Qwen2)
    qk_norm:         an RMSNorm over each head of q and of k, before RoPE (Qwen3, Gemma 3)
    qk_norm_full:    that RMSNorm over the whole q and k projections instead of each head (OLMoE)
    gemma_norms:     RMSNorm scales by (1 + w); norms after attention and after the MLP too
                     ("sandwich"); embeddings scaled by sqrt(hidden) (Gemma 2 and 3)
    activation:      the MLP's gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    fused_checkpoint: q|k|v and gate|up stored as one tensor each (Phi-3: qkv_proj, gate_up_proj)
    moe:             sparse mixture-of-experts blocks in place of the MLP (tessera/model/moe.py);
                     the expert count and routing are the config's (num_experts, ...)
    always_renormalize: the top-k routing weights always sum to 1, whatever the config says
                     (Mixtral has no norm_topk_prob)
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    gemma_norms: bool = False
    activation: str = "silu"
    fused_checkpoint: bool = False
    qk_norm_full: bool = False
    moe: bool = False
    always_renormalize: bool = False


_LLAMA = ArchTraits()
_GEMMA2 = ArchTraits(gemma_norms=True, activation="gelu_pytorch_tanh")

# Architecture (HF name, ModelArchConfig.architecture) -> traits. Every family is one class.
ARCH_TRAITS: dict[str, ArchTraits] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,  # Llama plus an optional sliding window (config)
    "Qwen2ForCausalLM": ArchTraits(qkv_bias=True),
    "Qwen3ForCausalLM": ArchTraits(qk_norm=True),
    "Gemma2ForCausalLM": _GEMMA2,  # plus soft-capping of attention and final logits (config)
    "Gemma3ForCausalLM": ArchTraits(qk_norm=True, gemma_norms=True,
                                    activation="gelu_pytorch_tanh"),
    "Phi3ForCausalLM": ArchTraits(fused_checkpoint=True),
    "Qwen2MoeForCausalLM": ArchTraits(qkv_bias=True, moe=True),  # plus a shared expert (config)
    "Qwen3MoeForCausalLM": ArchTraits(qk_norm=True, moe=True),
    "OlmoeForCausalLM": ArchTraits(qk_norm=True, qk_norm_full=True, moe=True),
    "MixtralForCausalLM": ArchTraits(moe=True, always_renormalize=True),  # Mistral's attention
}
_MODEL_CLASS = "tessera.model.llama:LlamaForCausalLM"

# Other HF architecture names -> the architecture they load as.
HF_ALIASES: dict[str, str] = {}

# GGUF general.architecture -> (architecture, Q/K rows permuted by llama.cpp's converter).
# Permuted: llama.cpp's interleaved RoPE; the others use NEOX-style RoPE and are stored as HF's.
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "gemma2": ("Gemma2ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
    "phi3": ("Phi3ForCausalLM", False),  # q|k|v and gate|up fused, split by the loader
    "qwen2moe": ("Qwen2MoeForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
    "olmoe": ("OlmoeForCausalLM", False),
}
# llama.cpp writes Mixtral as "llama" with expert tensors (an expert_count in the metadata)
GGUF_LLAMA_WITH_EXPERTS = "MixtralForCausalLM"

# invariant: the families the engine and simulator refuse to shard (tessera.utils) are the ones
# whose q/k norm spans all heads
assert {a for a, t in ARCH_TRAITS.items() if t.qk_norm_full} == QK_NORM_OVER_ALL_HEADS

# invariant: every alias and GGUF name loads as a registered architecture
assert set(HF_ALIASES.values()) | {a for a, _ in GGUF_ARCHITECTURES.values()} | {
    GGUF_LLAMA_WITH_EXPERTS
} <= set(ARCH_TRAITS)


def supported_architectures() -> list[str]:
    return sorted(ARCH_TRAITS)


def traits(architecture: str) -> ArchTraits:
    """The family traits of a registered architecture (ValueError naming the supported ones)."""
    found = ARCH_TRAITS.get(architecture)
    if found is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    return found


def has_qkv_bias(architecture: str) -> bool:
    """Whether the architecture's q/k/v projections carry a bias
    (ModelArchConfig.attention_bias)."""
    return traits(architecture).qkv_bias


def hf_architecture(hf_name: str) -> str | None:
    """The architecture an HF `config.json` name loads as (itself or through an alias); None if
    unsupported."""
    return hf_name if hf_name in ARCH_TRAITS else HF_ALIASES.get(hf_name)


def get_model_class(architecture: str) -> type:
    """The model class for an HF architecture name; ValueError naming the supported ones."""
    traits(architecture)
    module_name, _, class_name = _MODEL_CLASS.partition(":")
    cls: type = getattr(importlib.import_module(module_name), class_name)
    return cls
