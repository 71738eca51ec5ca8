"""KV cache groups on a real (tiny, random) Gemma 3 checkpoint that mixes local and global layers:
the cache is split into groups of two layers, each local group releases what its window left,
greedy tokens stay those of one full-length table per layer (--disable-hybrid-kv-cache-manager,
itself checked against HF here and in tests/model/test_families.py) alone, batched, preempted,
chunked and from the prefix cache, and at equal memory the engine holds more long requests at
once."""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera import LLM, SamplingParams
from tests.greedy_reference import check_greedy, hf_greedy

WINDOW = 8
# 4 local + 2 global layers: groups of gcd(4, 2) = 2 layers, global first
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention"]
PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(26 + i)] for i in range(5)]
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(checkpoint dir, HF model, greedy tokens of the one-group layout for PROMPTS)."""
    config = transformers.Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=LAYER_TYPES,
        tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    model = transformers.Gemma3ForCausalLM(config).eval()
    path = str(tmp_path_factory.mktemp("gemma3_hybrid"))
    model.save_pretrained(path)
    plain = _generate(LLM(model=path, block_size=4, max_model_len=48,
                          disable_hybrid_kv_cache_manager=True))
    longest = PROMPTS[-1]
    tie = check_greedy(model, longest, hf_greedy(model, longest, MAX_TOKENS), plain[-1])
    assert tie is None or "top-2 gap" in tie, tie
    return path, model, plain


def _generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _peak_running(llm: LLM) -> list[int]:
    """Counts the running requests after every schedule (the most is the concurrency)."""
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule
    seen: list[int] = []

    def counting():
        out = schedule()
        seen.append(len(scheduler.running))
        return out

    scheduler.schedule = counting
    return seen


def test_groups_hold_more_long_requests_at_equal_memory(gemma3):
    path, _, expected = gemma3
    common = dict(model=path, block_size=4, max_model_len=48, num_gpu_blocks_override=20,
                  enable_prefix_caching=False, preemption_mode="recompute")
    plain = LLM(disable_hybrid_kv_cache_manager=True, **common)
    hybrid = LLM(**common)
    bm_plain = plain.llm_engine.scheduler.block_manager
    bm = hybrid.llm_engine.scheduler.block_manager
    assert bm_plain.num_groups == 1 and bm_plain.num_gpu_blocks == 20
    assert bm.group_windows == (None, WINDOW, WINDOW) and bm.num_gpu_blocks == 60
    seen_plain, seen_hybrid = _peak_running(plain), _peak_running(hybrid)
    assert _generate(plain) == expected and _generate(hybrid) == expected
    assert max(seen_hybrid) > max(seen_plain)
    assert bm.num_released_blocks > 0 and bm_plain.num_released_blocks == 0
    plain_preempted = plain.get_metrics()["tessera:num_preemptions_total"]
    assert hybrid.get_metrics()["tessera:num_preemptions_total"] < plain_preempted
    bm.check_integrity()
    assert bm.gpu.num_free == bm.num_gpu_blocks


def test_equal_kv_cache_space_gives_more_smaller_blocks(gemma3):
    path, _, _ = gemma3
    common = dict(model=path, block_size=4, max_model_len=48, kv_cache_space=0.0001)
    plain = LLM(disable_hybrid_kv_cache_manager=True, **common)
    hybrid = LLM(**common)
    n_plain = plain.llm_engine.scheduler.block_manager.num_gpu_blocks
    n_hybrid = hybrid.llm_engine.scheduler.block_manager.num_gpu_blocks
    # a block of 2 layers instead of 6: three times as many
    assert n_hybrid // 3 == n_plain


@pytest.mark.parametrize("engine_args", [
    {"enable_chunked_prefill": True, "max_num_batched_tokens": 10},
    {"enable_prefix_caching": True},
], ids=["chunked", "prefix"])
def test_invariant_under_batching_and_scheduling(gemma3, engine_args):
    """(Preemption by swap and by recompute under groups: tests/model/test_families.py.)"""
    path, _, expected = gemma3
    llm = LLM(model=path, block_size=4, max_model_len=48, **engine_args)
    assert llm.llm_engine.scheduler.block_manager.num_groups == 3
    if "enable_chunked_prefill" in engine_args:  # one request alone: the same tokens
        assert _generate(llm, PROMPTS[-1:]) == expected[-1:]
    hits = llm.get_metrics()["tessera:prefix_cache_hits_total"]
    assert _generate(llm) == expected
    metrics = llm.get_metrics()
    if "enable_prefix_caching" in engine_args:  # the prompts again, from the cache of all groups
        assert _generate(llm) == expected
        assert llm.get_metrics()["tessera:prefix_cache_hits_total"] > metrics[
            "tessera:prefix_cache_hits_total"] >= hits
    llm.llm_engine.scheduler.block_manager.check_integrity()


def test_sdpa_backend_attends_through_each_groups_tables(gemma3):
    """The torch path (CUDA, and CPU without the C++ kernel): the same tokens, in a cache of 12
    blocks of every layer."""
    from tessera.attention.sdpa import SdpaBackend

    path, _, expected = gemma3
    llm = LLM(model=path, block_size=4, max_model_len=48, num_gpu_blocks_override=12,
              enable_prefix_caching=False)
    runner = llm.llm_engine.executor.runner
    runner.attn_backend = SdpaBackend(runner.device, runner.block_size)
    assert _generate(llm) == expected
    llm.llm_engine.scheduler.block_manager.check_integrity()


def test_grouped_cache_gives_the_same_prompt_logits(gemma3):
    """One forward pass over a prompt longer than the window: the grouped cache (3 slots shared
    by 3 groups) and one slot per layer give the same logits at every position."""
    from tessera.core.kv_cache_groups import kv_cache_groups
    from tessera.model.loader import load_model
    from tessera.model.registry import get_model_class
    from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
    from tessera.worker.model_runner import ModelRunner
    from tessera.worker.static_batch import StaticBatch

    path, _, _ = gemma3
    cpu, bs = torch.device("cpu"), 4
    cfg, weights = load_model(path)
    model = get_model_class(cfg.architecture)(cfg, weights, torch.float32, cpu, 64)
    logits = []
    for groups in ((), kv_cache_groups(cfg.layer_windows)):
        spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs,
                           torch.float32, groups)
        runner = ModelRunner(model, CacheEngine(spec, 3 * 16, 0, cpu), bs, cpu)
        assert runner.num_kv_cache_groups == max(len(groups), 1)
        batch = StaticBatch(runner, bs)
        prompt = PROMPTS[-1]
        seq = batch.new_seq(prompt, len(prompt))
        logits.append(batch.logits([seq], all_positions=True))
    assert len(kv_cache_groups(cfg.layer_windows)) == 3
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)


@pytest.mark.heavy
def test_tensor_parallel_2_keeps_the_groups(gemma3):
    """Each rank holds its KV heads of the same grouped layout; the scheduler's tables (one per
    group) drive both: the same tokens as one rank."""
    path, _, expected = gemma3
    llm = LLM(model=path, block_size=4, max_model_len=48, num_gpu_blocks_override=12,
              tensor_parallel_size=2)
    try:
        bm = llm.llm_engine.scheduler.block_manager
        assert bm.group_windows == (None, WINDOW, WINDOW) and bm.num_gpu_blocks == 36
        assert _generate(llm) == expected
        assert bm.num_released_blocks > 0
    finally:
        llm.llm_engine.shutdown()
