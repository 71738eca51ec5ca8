"""Every supported family against HF transformers: a tiny random checkpoint made with
transformers' own config class, saved with `save_pretrained`, loaded with `LLM(model=DIR)`.

Windows are shorter than the prompts, so the sliding window matters; norm weights are randomised
so that Gemma's (1 + w) matters. Checked: prompt logits in fp32 and bf16, greedy tokens against
HF's own decoding, and the same tokens under batching, preemption (both modes), chunked prefill
and prefix caching (with the sliding window releasing blocks as it moves)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera import LLM, SamplingParams
from tests.greedy_reference import check_greedy, hf_greedy

_COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               tie_word_embeddings=False)
WINDOW = 12
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                 "sliding_attention"])),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                         "original_max_position_embeddings": 128})),
}
PROMPTS = [list(range(10, 34)), [7] * 5 + list(range(60, 80)), [3, 5, 9, 33, 2, 8]]
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    config_name, model_name, extra = FAMILIES[request.param]
    config = getattr(transformers, config_name)(**{**_COMMON, **extra})
    config._attn_implementation = "eager"  # soft-capping and windows as HF's reference path
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return request.param, str(path), model, expected


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _check(model, got: list[list[int]], expected: list[list[int]]) -> None:
    for prompt, exp, g in zip(PROMPTS, expected, got, strict=True):
        tie = check_greedy(model, prompt, exp, g)
        assert tie is None or "top-2 gap" in tie


def test_greedy_matches_hf(family):
    name, path, model, expected = family
    _check(model, _greedy(LLM(model=path, max_model_len=256)), expected)


@pytest.mark.parametrize("family", ["mistral", "gemma3"], indirect=True)
@pytest.mark.parametrize("engine_args", [
    {"preemption_mode": "recompute"},
    {"preemption_mode": "swap"},
    {"enable_chunked_prefill": True, "max_num_batched_tokens": 16},
    {"enable_prefix_caching": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_max": 3, "prompt_lookup_min": 1}},
], ids=["recompute", "swap", "chunked", "prefix", "ngram"])
def test_invariant_under_scheduling(family, engine_args):
    """All three prompts fit the cache at admission, their outputs do not: preemptions, unless
    the window releases blocks (Mistral). Gemma 3 mixes local and global layers: one block table
    per KV cache group, the local groups releasing what their window left, in a cache small
    enough to preempt anyway. The tokens stay HF's."""
    name, path, model, expected = family
    # Gemma 3 here: 4 groups of one layer; 12 blocks of every layer = 48 pool blocks
    blocks, max_len = (17, 64) if name == "mistral" else (12, 48)
    llm = LLM(model=path, num_gpu_blocks_override=blocks, block_size=4, max_model_len=max_len,
              **engine_args)
    _check(model, _greedy(llm), expected)
    block_manager = llm.llm_engine.scheduler.block_manager
    if name == "mistral":  # every layer windowed: blocks behind the window were released
        assert block_manager.sliding_window == WINDOW and block_manager.num_released_blocks > 0
    else:  # local and global layers: the local groups released blocks, the global one none
        assert block_manager.sliding_window is None
        assert block_manager.group_windows == (None, WINDOW, WINDOW, WINDOW)
        assert block_manager.num_gpu_blocks == 4 * blocks
        assert block_manager.num_released_blocks > 0
        if "preemption_mode" in engine_args:
            assert llm.get_metrics()["tessera:num_preemptions_total"] > 0
    block_manager.check_integrity()
    if "enable_prefix_caching" in engine_args:  # the same prompts again: hits, same tokens
        _check(model, _greedy(llm), expected)


@pytest.mark.parametrize("family", ["mistral", "gemma3"], indirect=True)
def test_long_prompt_prefilled_in_chunks_through_a_small_cache(family):
    """A prompt whose whole length the window groups could not hold: with chunked prefill a
    window group holds its window and a chunk (block_manager.num_peak_blocks), so a cache too
    small for the whole prompt in every group starts, admits it and decodes HF's tokens."""
    name, path, model, _ = family
    prompt = [(5 * j) % 300 + 7 for j in range(70)]
    # window 12, chunks of 8, blocks of 4: a window group holds at most 6 blocks. Gemma 3: the
    # full group holds 24 (96 tokens), its three window groups 6 each, in 4 x 11 pool blocks
    blocks = 6 if name == "mistral" else 11
    llm = LLM(model=path, num_gpu_blocks_override=blocks, block_size=4, max_model_len=96,
              enable_chunked_prefill=True, max_num_batched_tokens=8,
              enable_prefix_caching=False)
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_gpu_blocks < bm.num_groups * (len(prompt) + MAX_TOKENS) // 4
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    tie = check_greedy(model, prompt, hf_greedy(model, prompt, MAX_TOKENS),
                       list(out.outputs[0].token_ids))
    assert tie is None or "top-2 gap" in tie
    assert bm.num_released_blocks > 0
    bm.check_integrity()
    assert bm.gpu.num_free == bm.num_gpu_blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_logits_match_hf(family, dtype):
    from tessera.model.loader import load_model
    from tessera.model.registry import get_model_class
    from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
    from tessera.worker.model_runner import ModelRunner
    from tessera.worker.static_batch import StaticBatch

    name, path, model, _ = family
    torch_dtype = getattr(torch, dtype)
    cpu, bs = torch.device("cpu"), 8
    cfg, weights = load_model(path)
    ours = get_model_class(cfg.architecture)(cfg, weights, torch_dtype, cpu, 256)
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs,
                       torch_dtype)
    batch = StaticBatch(ModelRunner(ours, CacheEngine(spec, 32, 0, cpu), bs, cpu), bs)
    prompt = PROMPTS[1]
    got = batch.logits([batch.new_seq(prompt, len(prompt))], all_positions=True).float()
    ref_model = model if dtype == "float32" else model.to(torch.bfloat16)
    try:
        with torch.inference_mode():
            ref = ref_model(torch.tensor([prompt])).logits[0].float()
    finally:
        model.float()
    tol = 2e-4 if dtype == "float32" else 0.1
    assert (got - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())
