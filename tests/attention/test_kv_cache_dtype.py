"""--kv-cache-dtype: the KV cache stored in another dtype than the compute dtype (bf16 K/V beside
fp32
activations), and everything that holds or moves KV following it: the device and swap pools, their
sizing from --kv-cache-space, preemption by swap, prefix caching, chunked prefill, the draft model's
cache. Greedy output with a bf16 cache stays invariant under batching/chunking/caching/preemption
(bitwise: the cache is rounded once, at write) and matches HF fp32 up to near-ties.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.config import CacheConfig, EngineArgs, GiB, resolve_kv_cache_dtype
from tessera.kernels.paged_attention import paged_attention_available


def test_auto_is_the_compute_dtype_and_explicit_values_win():
    assert EngineArgs().create_engine_config().cache.cache_dtype == "float32"
    assert EngineArgs(dtype="bfloat16").create_engine_config().cache.cache_dtype == "bfloat16"
    cfg = EngineArgs(kv_cache_dtype="bfloat16").create_engine_config()
    assert (cfg.model.dtype, cfg.cache.cache_dtype) == ("float32", "bfloat16")
    cfg = EngineArgs(dtype="bfloat16", kv_cache_dtype="float32").create_engine_config()
    assert (cfg.model.dtype, cfg.cache.cache_dtype) == ("bfloat16", "float32")
    assert resolve_kv_cache_dtype("auto", "bfloat16") == "bfloat16"


@pytest.mark.parametrize("value", ["fp8", "float16x", "int8", ""])
def test_unknown_value_is_a_value_error_naming_the_flag(value):
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        EngineArgs(kv_cache_dtype=value).create_engine_config()
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        CacheConfig(cache_dtype=value)
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        LLM(kv_cache_dtype=value)


def test_cli_flag():
    from tessera.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"])
    assert args.kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])


def _engine_cache(llm):
    return llm.llm_engine.executor.runner.cache_engine


def test_pools_and_sizing_follow_the_cache_dtype(make_llm):
    fp32 = make_llm(kv_cache_space=0.05, swap_space=0.05)
    bf16 = make_llm(kv_cache_space=0.05, swap_space=0.05, kv_cache_dtype="bfloat16")
    a, b = _engine_cache(fp32), _engine_cache(bf16)
    assert a.gpu_cache.dtype == a.cpu_cache.dtype == torch.float32
    assert b.gpu_cache.dtype == b.cpu_cache.dtype == torch.bfloat16
    assert b.spec.block_bytes * 2 == a.spec.block_bytes
    # the same GiB hold twice the blocks (and so twice the tokens), up to the partial block
    assert b.num_gpu_blocks in (2 * a.num_gpu_blocks, 2 * a.num_gpu_blocks + 1)
    assert b.num_cpu_blocks in (2 * a.num_cpu_blocks, 2 * a.num_cpu_blocks + 1)
    assert b.num_gpu_blocks == int(0.05 * GiB) // b.spec.block_bytes
    assert b.gpu_cache.nbytes == b.num_gpu_blocks * b.spec.block_bytes <= 0.05 * GiB


def _random_prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(100, 49000, int(n)).tolist()} for n in lengths]


@pytest.fixture(scope="module")
def kernels_built():
    if not paged_attention_available(torch.device("cpu"), torch.float32, torch.bfloat16):
        pytest.skip("the paged attention kernel is not built here")


def test_bf16_cache_greedy_is_invariant(make_llm, kernels_built):
    """Chunked prefill, prefix-cache hits, swap preemption and batching give the same tokens as one
    plain run, bitwise, with fp32 compute over a bf16 cache."""
    prompts = _random_prompts(1, [120, 200, 70])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(llm, batch=prompts):
        return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]

    bf16 = {"kv_cache_dtype": "bfloat16"}
    base = run(make_llm(**bf16))
    assert run(make_llm(enable_chunked_prefill=True, max_num_batched_tokens=64, **bf16)) == base
    cached = make_llm(enable_prefix_caching=True, **bf16)
    run(cached)
    assert run(cached) == base
    assert cached.get_metrics()["tessera:prefix_cache_hits_total"] > 0
    # 28 blocks: the three prompts are admitted (26 blocks), then outgrow the pool
    small = make_llm(num_gpu_blocks_override=28, max_model_len=384, preemption_mode="swap", **bf16)
    assert run(small) == base
    assert small.get_metrics()["tessera:num_preemptions_total"] > 0
    assert _engine_cache(small).cpu_cache.dtype == torch.bfloat16


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List three prime numbers:",
]


@pytest.mark.heavy  # ~90 s on two busy cores: over the default suite's budget
def test_bf16_cache_greedy_matches_hf_fp32(make_llm, hf_model, default_tokenizer, kernels_built):
    """fp32 compute over a bf16 cache against HF fp32 on the same weights: identical tokens, or a
    first difference at a near-tie (the rule of tests/greedy_reference.py), on at most one
    prompt."""
    from greedy_reference import check_greedy, hf_greedy

    llm = make_llm(kv_cache_dtype="bfloat16")
    ids = [default_tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids
           for o in llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)]
    near_ties = [r for p, g in zip(ids, got, strict=True)
                 if (r := check_greedy(hf_model, p, hf_greedy(hf_model, p, 32), g))]
    for r in near_ties:
        print(r)  # reported, not hidden
    assert len(near_ties) <= 1, near_ties


def test_draft_model_cache_follows_the_dtype(default_model_path, model_bundle, kernels_built):
    """The target drafting for itself keeps a cache of its own: in the --kv-cache-dtype too."""
    from tessera.engine.llm_engine import LLMEngine

    args = EngineArgs(max_model_len=256, kv_cache_dtype="bfloat16", quantization="gguf",
                      speculative_config={
        "method": "draft_model", "model": default_model_path, "num_speculative_tokens": 2})
    llm = LLM.from_engine(LLMEngine.from_engine_args(args, bundle=model_bundle))
    runner = llm.llm_engine.executor.runner
    assert runner.draft_proposer.cache.gpu_cache.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = _random_prompts(2, [40, 70])
    with_drafts = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    plain = LLM.from_engine(LLMEngine.from_engine_args(
        EngineArgs(max_model_len=256, kv_cache_dtype="bfloat16", quantization="gguf"),
        bundle=model_bundle))
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)] \
        == with_drafts
