"""`--dtype auto` (the default, as in vLLM): the checkpoint's stored dtype decides; half/float16
is refused on CPU with the reason, before any weight is read."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tessera import LLM, SamplingParams
from tessera.config import EngineArgs, resolve_dtype
from tessera.entrypoints.cli import main
from tessera.model.checkpoint_dtype import checkpoint_dtype


def test_resolve_dtype_spellings():
    assert resolve_dtype("auto", "bfloat16", "cpu") == "bfloat16"
    assert resolve_dtype("auto", None, "cpu") == "float32"
    assert resolve_dtype("float", "bfloat16", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "float32", "cpu") == "bfloat16"
    assert resolve_dtype("half", None, "cuda:0") == "float16"  # refused on CPU only
    for half in ("half", "float16"):
        with pytest.raises(ValueError, match=f"--dtype {half} is not supported on CPU.*bfloat16"):
            resolve_dtype(half, None, "cpu")
    with pytest.raises(ValueError, match="--dtype must be one of"):
        resolve_dtype("fp8", None, "cpu")


def test_engine_args_default_is_auto():
    assert EngineArgs().dtype == "auto"
    assert EngineArgs().create_engine_config(128, "bfloat16").model.dtype == "bfloat16"
    assert EngineArgs().create_engine_config(128).model.dtype == "float32"
    with pytest.raises(ValueError, match="not supported on CPU"):
        EngineArgs(dtype="half").create_engine_config(128)


def _hf_config_dir(tmp_path, **keys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      **keys}))
    return str(tmp_path)


@pytest.mark.parametrize("keys, expected", [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),   # transformers v4
    ({"dtype": "bfloat16"}, "bfloat16"),         # transformers v5
    ({"torch_dtype": "float32"}, "float32"),
    ({"torch_dtype": "float16"}, "float32"),     # exact in fp32; fp16 has no CPU path
    ({}, "float32"),
])
def test_hf_checkpoint_dtype(tmp_path, keys, expected):
    assert checkpoint_dtype(_hf_config_dir(tmp_path, **keys)) == expected


@pytest.mark.parametrize("qtype, expected", [
    (gguf.GGMLQuantizationType.BF16, "bfloat16"),
    (gguf.GGMLQuantizationType.F16, "float32"),
    (gguf.GGMLQuantizationType.Q8_0, "float32"),
])
def test_gguf_checkpoint_dtype(tmp_path, qtype, expected):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert checkpoint_dtype(str(path)) == expected


def test_default_model_runs_in_float32(default_model_path):
    # a quantized GGUF: llama.cpp's activation type, so results equal --dtype float32's
    assert checkpoint_dtype(default_model_path) == "float32"


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    path = tmp_path_factory.mktemp("bf16")
    model.save_pretrained(path)
    assert json.loads((path / "config.json").read_text()).get(
        "torch_dtype", json.loads((path / "config.json").read_text()).get("dtype")) == "bfloat16"
    return str(path)


def test_bf16_checkpoint_runs_in_bf16(bf16_checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 9, 33]}, {"prompt_token_ids": list(range(10, 40))}]
    tokens = {}
    for dtype in ("auto", "bfloat16", "float32"):
        llm = LLM(model=bf16_checkpoint, dtype=dtype, max_model_len=128)
        resolved = llm.llm_engine.config.model.dtype
        assert resolved == ("bfloat16" if dtype == "auto" else dtype)
        runner = llm.llm_engine.executor.runner
        assert runner.model.dtype == runner.cache_engine.spec.dtype == getattr(torch, resolved)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[dtype] = [o.outputs[0].token_ids for o in outs]
    assert tokens["auto"] == tokens["bfloat16"]


def test_cli_refuses_half_before_loading(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--dtype", "half", "--port", "0"])
    assert e.value.code == 2
    assert "--dtype half is not supported on CPU" in capsys.readouterr().err
