"""Mixture-of-experts GGUF files written here as llama.cpp's converter writes them (`qwen3moe`,
`olmoe`, and `llama` with expert tensors for Mixtral): the router as `ffn_gate_inp`, every
expert of a layer in one 3-D tensor `ffn_{gate,up,down}_exps` [E, out, in], Mixtral's Q/K rows
permuted for llama.cpp's RoPE. From a tiny random HF model: the logits of the float file equal
HF's; a file with quantized experts keeps them quantized, one slice per expert, and equals the
same file dequantized at load."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tessera.model.gguf_quant import QuantizedTensor
from tessera.model.hf_loader import load_hf_dir
from tessera.model.loader import load_model
from tests.gguf_header import add_decoder_header
from tests.model.test_moe_families import make_hf_moe
from tests.model_logits import model_logits

_NAMES = {  # HF leaf -> llama.cpp's name
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
# family -> (llama.cpp arch, HF overrides llama.cpp's graph implies)
CASES = {
    "qwen3_moe": ("qwen3moe", dict(mlp_only_layers=[])),  # every layer sparse, renormalised
    "qwen2_moe": ("qwen2moe", dict(decoder_sparse_step=1)),  # a shared expert, q/k/v biases
    "olmoe": ("olmoe", dict(clip_qkv=None, num_key_value_heads=4)),  # k norm over all heads
    "mixtral": ("llama", dict(sliding_window=None)),
}


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (pairs (j, j + D/2) -> (2j, 2j + 1))."""
    d = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(path, arch: str, hf_dir: str, expert_type=None, per_expert=False) -> None:
    """The checkpoint in `hf_dir` as llama.cpp writes `arch`; expert tensors quantized to
    `expert_type` (a gguf.GGMLQuantizationType) when given; `per_expert`: one 2-D tensor per
    expert (`blk.{i}.ffn_gate.{e}.weight`, early Mixtral GGUFs)."""
    cfg, weights = load_hf_dir(hf_dir)
    writer = gguf.GGUFWriter(str(path), arch)
    add_decoder_header(writer, cfg, cfg.rope_theta)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in weights.items():
        w = t.numpy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", w)
            continue
        if name in ("model.norm.weight", "lm_head.weight"):
            gname = "output_norm.weight" if name == "model.norm.weight" else "output.weight"
            writer.add_tensor(gname, w)
            continue
        layer, leaf = name.removeprefix("model.layers.").split(".", 1)
        leaf, _, kind = leaf.rpartition(".")  # weight or bias
        if ".experts." in leaf:
            _, _, e, proj = leaf.split(".")
            experts.setdefault((layer, proj), {})[int(e)] = w
            continue
        if arch == "llama" and leaf in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if "q_proj" in leaf else cfg.num_key_value_heads
            w = _permute(w, heads)
        if leaf == "mlp.shared_expert_gate":
            w = w.reshape(-1)  # llama.cpp's [hidden] vector
        writer.add_tensor(f"blk.{layer}.{_NAMES[leaf]}.{kind}", np.ascontiguousarray(w))
    for (layer, proj), by_id in experts.items():
        if per_expert:
            for e, w in sorted(by_id.items()):
                writer.add_tensor(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}.{e}.weight", w)
            continue
        stacked = np.stack([by_id[e] for e in range(cfg.num_experts)])  # [E, out, in]
        name = f"blk.{layer}.{_EXPERTS[proj]}.weight"
        if expert_type is None:
            writer.add_tensor(name, stacked)
        else:
            writer.add_tensor(name, gguf.quants.quantize(stacked, expert_type),
                              raw_dtype=expert_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


PROMPT = list(range(5, 35))


@pytest.mark.parametrize("family, per_expert", [(f, False) for f in sorted(CASES)] + [
    ("mixtral", True)])
def test_gguf_logits_match_hf(family, per_expert, tmp_path):
    arch, overrides = CASES[family]
    model = make_hf_moe(family, **overrides)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{family}.gguf"
    write_moe_gguf(path, arch, str(tmp_path / "hf"), per_expert=per_expert)
    cfg, _ = load_model(str(path))
    assert cfg.architecture == type(model).__name__ and cfg.num_experts == 8
    got = model_logits(str(path), PROMPT)
    with torch.inference_mode():
        ref = model(torch.tensor([PROMPT])).logits[0].float()
    assert (got - ref).abs().max().item() < 2e-4 * max(1.0, ref.abs().max().item())


def test_quantized_experts_stay_quantized(tmp_path):
    """Q4_0 experts (the kernels' blocks, per expert) give the logits of the same file
    dequantized at load; and far from the float model's, so the blocks are what ran."""
    model = make_hf_moe("qwen3_moe", mlp_only_layers=[])
    model.save_pretrained(tmp_path / "hf")
    path = str(tmp_path / "q.gguf")
    write_moe_gguf(path, "qwen3moe", str(tmp_path / "hf"), gguf.GGMLQuantizationType.Q4_0)
    _, weights = load_model(path, "gguf")
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    assert isinstance(weights[name], QuantizedTensor) and tuple(weights[name].shape) == (64, 32)
    quantized = model_logits(path, PROMPT, "gguf")
    dequantized = model_logits(path, PROMPT, "none")
    assert (quantized - dequantized).abs().max().item() < 1e-4 * dequantized.abs().max().item()
    with torch.inference_mode():
        ref = model(torch.tensor([PROMPT])).logits[0].float()
    assert (quantized - ref).abs().max().item() > 1e-3  # Q4_0 is not the float weights
