"""Tiny random Llama checkpoints (HF safetensors, no tokenizer) for the tensor-parallel tests:
four query heads, so tensor-parallel size 2 splits them; KV heads 2 (split) or 1 (replicated)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def save_tiny_llama(path: str, num_kv_heads: int, vocab_size: int = 320, seed: int = 0):
    """Save a random fp32 Llama at `path`; returns the HF model (the reference)."""
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


# prompts of assorted lengths (token ids below every tiny vocabulary)
PROMPTS = [[1, 5, 9, 33], list(range(10, 60)), [7] * 13, list(range(100, 300, 3)),
           [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], list(range(200, 120, -2))]


def save_tiny_llama_with_tokenizer(path: str, tokenizer_source: str):
    """A tiny random Llama over the default model's vocabulary, with its tokenizer (and chat
    template) saved alongside: text in, text out, in a checkpoint that loads in a second."""
    from tessera.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_source)
    model = save_tiny_llama(path, num_kv_heads=2, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(path)
    return model
