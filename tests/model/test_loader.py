"""The GGUF loader: the default model against HF transformers' own GGUF loading, and synthetic
GGUFs of every quant type (HF directories, the registry and the default model's path:
test_model_sources.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tessera.model.gguf_loader import (
    dequantize_tensor,
    llama3_rope_factors,
    llama3_rope_scaling_from_factors,
)
from tessera.model.loader import load_model

Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------- (a) the real GGUF vs HF


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    """HF transformers' model loaded from the same GGUF (the session's, tests/conftest.py): its
    state dict and config."""
    return hf_model.state_dict(), hf_model.config


@pytest.fixture(scope="module")
def ours(default_model_path):
    return load_model(default_model_path)


def test_gguf_weights_match_hf(ours, hf_reference):
    config, weights = ours
    hf_state, _ = hf_reference
    assert set(weights) == set(config.weight_names())
    assert set(weights) <= set(hf_state)
    for name, w in weights.items():
        assert w.dtype == torch.float32 and w.device.type == "cpu"
        ref = hf_state[name]
        assert w.shape == ref.shape, name
        # Same dequantiser underneath, so equal bit for bit; Q/K rows in HF's order proves the
        # un-permutation (a wrong order would differ by O(weights)).
        assert torch.equal(w, ref), f"{name}: max abs diff {(w - ref).abs().max()}"
    # Tied: HF's lm_head is the embedding, and we return no lm_head at all.
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert torch.equal(hf_state["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_gguf_config_matches_hf(ours, hf_reference):
    config, _ = ours
    _, hf = hf_reference
    assert config.architecture == "LlamaForCausalLM"
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
    ):
        assert getattr(config, field) == getattr(hf, field), field
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert config.rope_theta == rope["rope_theta"]
    assert config.rope_scaling is None
    assert config.attention_bias is False
    assert config.eos_token_ids == (hf.eos_token_id,)


# ---------------------------------------------------------------- (b) synthetic GGUFs


def _llamacpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's Q/K rows (written independently of ours)."""
    head_dim = w.shape[0] // num_heads
    out = np.empty_like(w)
    for h in range(num_heads):
        for j in range(head_dim // 2):
            for p in range(2):  # GGUF row 2j+p holds HF row j + p*head_dim/2
                out[h * head_dim + 2 * j + p] = w[h * head_dim + j + p * head_dim // 2]
    return out


def _quant_roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    if qtype == Q.F32:
        return w
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def _add(writer, name: str, w: np.ndarray, qtype) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


# Quantisable types (gguf can quantize them) with a tolerance relative to max |w|.
_QUANT_TOL = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 1e-2,
    Q.Q8_0: 1e-2,
    Q.Q5_0: 0.07,
    Q.Q5_1: 0.07,
    Q.Q4_0: 0.15,
    Q.Q4_1: 0.15,
}


def _write_tiny_gguf(path, arch: str, tied: bool, rope_freqs: np.ndarray | None = None):
    """A 2-layer model with every quantisable type among its tensors. Returns the HF-layout
    weights it was made from (before quantisation) and the type each was stored as."""
    rng = np.random.default_rng(0)
    vocab, hidden, ffn, heads, kv_heads, layers = 256, 64, 96, 4, 2, 2
    head_dim = hidden // heads
    types = list(_QUANT_TOL)
    hf: dict[str, tuple[np.ndarray, object]] = {}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)

    def tensor(gguf_name, hf_name, shape, qtype, permute_heads=None):
        w = rng.standard_normal(shape).astype(np.float32)
        stored = w if permute_heads is None else _llamacpp_permute(w, permute_heads)
        _add(writer, gguf_name, stored, qtype)
        hf[hf_name] = (w, qtype, stored)

    t = iter(types * 10)
    tensor("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden), Q.Q8_0)
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        perm = arch == "llama"
        tensor(
            b + "attn_q.weight",
            p + "self_attn.q_proj.weight",
            (heads * head_dim, hidden),
            next(t),
            heads if perm else None,
        )
        tensor(
            b + "attn_k.weight",
            p + "self_attn.k_proj.weight",
            (kv_heads * head_dim, hidden),
            next(t),
            kv_heads if perm else None,
        )
        tensor(
            b + "attn_v.weight",
            p + "self_attn.v_proj.weight",
            (kv_heads * head_dim, hidden),
            next(t),
        )
        if arch == "qwen2":
            tensor(b + "attn_q.bias", p + "self_attn.q_proj.bias", (heads * head_dim,), Q.F32)
            tensor(b + "attn_k.bias", p + "self_attn.k_proj.bias", (kv_heads * head_dim,), Q.F32)
            tensor(b + "attn_v.bias", p + "self_attn.v_proj.bias", (kv_heads * head_dim,), Q.F32)
        tensor(b + "attn_output.weight", p + "self_attn.o_proj.weight", (hidden, hidden), next(t))
        tensor(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (ffn, hidden), next(t))
        tensor(b + "ffn_up.weight", p + "mlp.up_proj.weight", (ffn, hidden), next(t))
        tensor(b + "ffn_down.weight", p + "mlp.down_proj.weight", (hidden, ffn), next(t))
        tensor(b + "attn_norm.weight", p + "input_layernorm.weight", (hidden,), Q.F32)
        tensor(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (hidden,), Q.F32)
    tensor("output_norm.weight", "model.norm.weight", (hidden,), Q.F32)
    if not tied:
        tensor("output.weight", "lm_head.weight", (vocab, hidden), Q.Q4_1)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True)])
def test_synthetic_gguf_roundtrip(tmp_path, arch, tied):
    path = tmp_path / "tiny.gguf"
    hf = _write_tiny_gguf(path, arch, tied)
    config, weights = load_model(str(path))

    assert config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (256, 64, 96)
    assert (config.num_hidden_layers, config.num_attention_heads) == (2, 4)
    assert (config.num_key_value_heads, config.head_dim) == (2, 16)
    assert config.rope_theta == 500000.0 and config.rope_scaling is None
    assert config.max_position_embeddings == 512
    assert config.tie_word_embeddings is tied
    assert config.attention_bias is (arch == "qwen2")
    assert config.bos_token_id == 1 and config.eos_token_ids == (2, 3)
    assert set(weights) == set(hf)

    for name, (w, qtype, stored) in hf.items():
        got = weights[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == w.shape, name
        # Exactly gguf's own quantise -> dequantise of what was stored, un-permuted ...
        expect = _quant_roundtrip(stored, qtype)
        if stored is not w:  # permuted Q/K: invert with the test's own permutation
            heads = 4 if ".q_proj." in name else 2
            inverse = _llamacpp_permute(np.arange(w.shape[0]), heads)
            unpermuted = np.empty_like(expect)
            unpermuted[inverse] = expect
            expect = unpermuted
        np.testing.assert_array_equal(got.numpy(), expect, err_msg=name)
        # ... and close to the original weights, within the type's precision.
        tol = _QUANT_TOL[qtype] * np.abs(w).max()
        assert np.abs(got.numpy() - w).max() <= tol, (name, qtype)


@pytest.mark.parametrize("quantization", ["gguf", "gguf_int8"])
def test_every_type_with_a_kernel_stays_in_its_blocks(tmp_path, quantization):
    """Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 matrices (Q5_1 included on the exact path: 10 bits a weight
    where a float32 copy took 32) stay quantized, with the dequantized model's values."""
    from tessera.model.gguf_quant import KERNEL_FORMATS, QuantizedTensor

    path = tmp_path / "tiny.gguf"
    hf = _write_tiny_gguf(path, "llama", tied=False)
    _, kept = load_model(str(path), quantization)
    _, dense = load_model(str(path), "none")
    matrices = {n: q for n, (w, q, _) in hf.items() if w.ndim == 2 and q in KERNEL_FORMATS}
    assert Q.Q5_1 in matrices.values()
    for name in matrices:
        got = kept[name]
        assert isinstance(got, QuantizedTensor) and got.int8 == (quantization == "gguf_int8"), name
        assert torch.equal(got.dequantize(), dense[name]), name


@pytest.mark.parametrize(
    "qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.BF16], ids=lambda q: q.name
)
def test_dequantize_every_type(tmp_path, qtype):
    """Types gguf cannot quantize (K-quants, IQ): random blocks must come back in the right shape
    and order, equal to gguf's dequantisation of the same bytes."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * 256
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(rows, cols // block_size * type_size), dtype=np.uint8)
    raw &= 0xBF  # clears an exponent bit of every embedded fp16 scale: no inf/nan blocks
    if qtype == Q.BF16:
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("t", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    (tensor,) = gguf.GGUFReader(str(path)).tensors
    got = dequantize_tensor(tensor)
    assert got.shape == (rows, cols) and got.dtype == np.float32
    expect = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    np.testing.assert_array_equal(got, expect)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    # Fitting path: enough blended frequencies to solve for high_freq_factor and the context.
    scaling = {
        "rope_type": "llama3",
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 2.0,
        "original_max_position_embeddings": 4096,
    }
    factors = llama3_rope_factors(scaling, 500000.0, 128).astype(np.float32)
    assert llama3_rope_scaling_from_factors(factors, 500000.0, 128) == scaling
    # In a GGUF with a tiny head_dim only one frequency blends: falls back to Meta's defaults.
    meta = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    path = tmp_path / "rope.gguf"
    _write_tiny_gguf(path, "llama", tied=True, rope_freqs=llama3_rope_factors(meta, 500000.0, 16))
    config, weights = load_model(str(path))
    assert config.rope_scaling == meta
    assert not any("rope" in name for name in weights)
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_rope_scaling_from_factors(np.linspace(1, 3, 64), 500000.0, 128)
