"""Greedy results do not depend on batching, preemption (swap or recompute), chunked prefill or
prefix caching: 24 prompts x 48 tokens, token ids identical across every configuration.

A divergence is allowed only at a numerical near-tie of the HF reference (top-2 logits within 1e-3),
reported by the test; more than one distinct near-tie in the suite fails it.
"""

from __future__ import annotations

import pytest
from greedy_reference import check_greedy

from tessera import SamplingParams

NUM_TOKENS = 48
SHARED = (
    "You are a careful assistant. Answer briefly and precisely, cite the facts you rely on, and "
    "say so when you do not know. Keep a neutral tone and never invent sources. The user asks: "
)
TOPICS = [
    "why is the sky blue", "how do vaccines work", "what is a prime number", "who wrote Hamlet",
    "how far is the moon", "what is entropy", "why do cats purr", "how does a transistor work",
    "what causes tides", "what is photosynthesis", "how do bees make honey", "what is inflation",
]


def _prompts(tokenizer) -> list[list[int]]:
    shared = [tokenizer.encode(SHARED + t + "?") for t in TOPICS]  # long common prefix
    varied = [
        tokenizer.encode(f"Story {i}: " + "once upon a time " * (i * 3) + "there was")
        for i in range(12)
    ]
    return shared + varied


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return _prompts(default_tokenizer)


def _run(llm, prompts, one_by_one: bool = False) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    if one_by_one:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(make_llm, prompts):
    """(a) an ample cache, everything in one batch."""
    return _run(make_llm(), prompts)




def _assert_same(hf_model, prompts, baseline, got, label):
    near_ties: set[str] = set()  # this test's own: one near-tie allowed per test
    for p, expected, g in zip(prompts, baseline, got, strict=True):
        assert len(g) == NUM_TOKENS, label
        if tie := check_greedy(hf_model, p, expected, g):
            print(f"[{label}] {tie}")
            near_ties.add(f"{p[-5:]}:{tie.split(':')[1]}")
    assert len(near_ties) <= 1, f"more than one near-tie in {label}: {near_ties}"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_does_not_change_greedy(make_llm, hf_model, prompts, baseline, mode):
    # 40 blocks of 16 hold 640 tokens: the engine refuses a max_model_len the cache cannot hold
    llm = make_llm(num_gpu_blocks_override=40, max_model_len=640, preemption_mode=mode,
                   swap_space=0.5)
    got = _run(llm, prompts)
    assert llm.get_metrics()["tessera:num_preemptions_total"] > 0
    _assert_same(hf_model, prompts, baseline, got, f"preempt-{mode}")


def test_chunked_prefill_does_not_change_greedy(make_llm, hf_model, prompts, baseline):
    llm = make_llm(enable_chunked_prefill=True, max_num_batched_tokens=64)
    _assert_same(hf_model, prompts, baseline, _run(llm, prompts), "chunked")


def test_prefix_caching_does_not_change_greedy(make_llm, hf_model, prompts, baseline):
    llm = make_llm(enable_prefix_caching=True, max_num_seqs=4)
    got = _run(llm, prompts)
    assert llm.get_metrics()["tessera:prefix_cache_hits_total"] > 0
    _assert_same(hf_model, prompts, baseline, got, "prefix-cache")


def test_each_prompt_alone_gives_the_batched_result(make_llm, hf_model, prompts, baseline):
    _assert_same(hf_model, prompts, baseline, _run(make_llm(), prompts, one_by_one=True), "alone")
