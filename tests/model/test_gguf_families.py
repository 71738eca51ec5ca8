"""GGUF files of the newer families, written here the way llama.cpp's converter writes them (its
tensor names, Gemma's norms stored as 1 + w, NEOX-style RoPE stored unpermuted), from a tiny random
HF model: the logits of the loaded file equal HF's own on the same weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from tessera.model.loader import load_model
from tessera.model.registry import get_model_class
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
from tessera.worker.model_runner import ModelRunner
from tessera.worker.static_batch import StaticBatch
from tests.gguf_header import add_decoder_header

_LAYER_NAMES = {  # HF leaf -> llama.cpp's name
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
_GEMMA_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_LLAMA_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "ffn_norm"}
WINDOW = 10
CASES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, num_hidden_layers=2)),
    # llama.cpp's Gemma 3: five local layers to one global, local base 10k, scale 1/sqrt(head_dim)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, num_hidden_layers=6, sliding_window=WINDOW,
                    query_pre_attn_scalar=16, rope_parameters={
                        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # llama.cpp's Gemma 2: local and global layers alternate, from a local one
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, num_hidden_layers=4, sliding_window=WINDOW,
                    query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0, rope_parameters={"rope_type": "default",
                                                                  "rope_theta": 1e6})),
}


def _write_gguf(path, arch: str, model) -> None:
    cfg = model.config
    gemma = arch.startswith("gemma")
    writer = gguf.GGUFWriter(str(path), arch)
    add_decoder_header(writer, cfg, 1e6 if gemma else 10000.0)
    if gemma:
        writer.add_sliding_window(WINDOW)
    if arch == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", cfg.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", cfg.final_logit_softcapping)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = _GEMMA_NAMES if gemma else _LLAMA_NAMES
    for name, p in model.state_dict().items():
        w = p.float().numpy()
        if gemma and name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp stores Gemma's norms as 1 + w
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, leaf = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{names[leaf.removesuffix('.weight')]}.weight"
        writer.add_tensor(gname, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", sorted(CASES))
def test_gguf_logits_match_hf(arch, tmp_path):
    config_name, model_name, extra = CASES[arch]
    config = getattr(transformers, config_name)(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(path, arch, model)

    cfg, weights = load_model(str(path))
    assert cfg.architecture == model_name
    cpu, bs = torch.device("cpu"), 8
    ours = get_model_class(cfg.architecture)(cfg, weights, torch.float32, cpu, 256)
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs,
                       torch.float32)
    batch = StaticBatch(ModelRunner(ours, CacheEngine(spec, 16, 0, cpu), bs, cpu), bs)
    prompt = list(range(5, 35))  # longer than the window
    got = batch.logits([batch.new_seq(prompt, len(prompt))], all_positions=True).float()
    with torch.inference_mode():
        ref = model(torch.tensor([prompt])).logits[0].float()
    assert (got - ref).abs().max().item() < 2e-4 * max(1.0, ref.abs().max().item())
