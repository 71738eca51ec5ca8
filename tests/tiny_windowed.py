"""Tiny random windowed models the window tests share: Mistral-style (every layer within an
8-token window) and Gemma-3-style (local and global layers: KV cache groups), one vocabulary, so
one Llama can draft for both."""

from __future__ import annotations

import torch
import transformers

WINDOW = 8
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
              tie_word_embeddings=False)
# name -> (transformers config class, model class, fields beside COMMON)
TARGETS = {
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                 "sliding_attention"])),
}


def save_tiny(path, config_name: str, model_name: str, extra: dict, seed: int) -> str:
    """A random model of transformers' `model_name` saved to `path` (an HF directory)."""
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    getattr(transformers, model_name)(config).eval().save_pretrained(path)
    return str(path)
