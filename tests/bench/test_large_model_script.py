"""benchmarks/large_model.py writes a GGUF our loader reads back as the transformers model it was
made from: names, Q/K row order (llama.cpp's permutation) and shapes, within Q8_0's rounding.
A tiny model of the same layout stands in for the 1B one (the benchmark itself is not run)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "large_model.py")
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


@pytest.fixture(scope="module")
def large_model():
    spec = importlib.util.spec_from_file_location("large_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.heavy  # ~30 s: it checks a benchmark's converter, not the product
def test_written_gguf_loads_back_as_the_hf_model(large_model, tmp_path, default_model_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tessera.model.loader import load_model
    from tessera.tokenizer import load_tokenizer

    path = large_model.build(str(tmp_path), ["q8_0"], arch=TINY)["q8_0"]
    torch.manual_seed(0)  # the script's seed: the same random model again
    hf = LlamaForCausalLM(LlamaConfig(**{**large_model.ARCH, **TINY})).state_dict()
    cfg, weights = load_model(path, "none")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (64, 2, 2)
    assert set(weights) == set(hf)
    for name, w in weights.items():
        ref = hf[name].float()
        # Q8_0: |error| <= half a step of the block's scale (max |w| / 127)
        assert torch.allclose(w, ref, atol=float(ref.abs().max()) / 127), name
    assert load_tokenizer(path).encode("Hello world") == load_tokenizer(default_model_path).encode(
        "Hello world")
