"""A tiny randomly initialised HF checkpoint (no tokenizer) served by the engine: greedy tokens
equal
HF's own generate, for Llama and for Qwen2 (q/k/v bias), batched, alone and under preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tessera import LLM, SamplingParams

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny_checkpoint(request, tmp_path_factory):
    config_cls, model_cls, extra = ARCHS[request.param]
    config = config_cls(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False, **extra,
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return str(path), model


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_tiny_checkpoint_matches_hf(tiny_checkpoint):
    path, model = tiny_checkpoint
    prompts = [[1, 5, 9, 33], list(range(10, 60)), [7] * 13, list(range(100, 300, 3))]
    expected = [_hf_greedy(model, p, 12) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # 24 blocks of 4 hold 96 tokens, so max_model_len 96 (the engine refuses more)
    for engine_args in ({"max_model_len": 256},
                        {"num_gpu_blocks_override": 24, "block_size": 4, "max_model_len": 96}):
        llm = LLM(model=path, **engine_args)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, engine_args
        assert all(o.outputs[0].text == "" for o in outs)  # no tokenizer, no text
        if "num_gpu_blocks_override" in engine_args:
            assert llm.get_metrics()["tessera:num_preemptions_total"] > 0
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("a string prompt needs a tokenizer", params, use_tqdm=False)
