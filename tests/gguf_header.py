"""The decoder header every tiny GGUF the tests write shares: one place for llama.cpp's keys."""

from __future__ import annotations

import gguf


def add_decoder_header(writer: gguf.GGUFWriter, cfg, rope_base: float) -> None:
    """Layer count, sizes, heads, head dims, RMSNorm eps and RoPE base of an HF config `cfg`."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_base)
