"""A tiny random Qwen3-MoE checkpoint (HF safetensors, no tokenizer) for the tensor- and
expert-parallel tests: 8 experts, top-2, four query heads and two KV heads (so two ranks split
them), one dense layer beside two MoE layers.

The router is scaled up so each token's top-2 experts are clear winners: a random router at the
default init sits at near-ties, where a float sum in another order picks another expert."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def save_tiny_qwen3_moe(path: str, seed: int = 0, **overrides):
    """Save a random fp32 Qwen3-MoE at `path`; returns the HF model (the reference)."""
    config = Qwen3MoeConfig(**{
        "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "mlp_only_layers": [1], **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # the router: decisive top-2
                p.mul_(40.0)
    model.save_pretrained(path)
    return model
