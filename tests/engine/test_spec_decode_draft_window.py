"""Speculative decoding with a draft model on a target with a sliding window: the target's window
groups still release blocks, the draft keeps a full table of its own in a pool of its own (the
scheduler's draft KV cache group, core/block_manager.py), and greedy output stays that of plain
decoding, alone, batched, under preemption (swap and recompute) and chunked prefill, with
prompts longer than the window. Mistral-style (every layer windowed) and Gemma-3-style (local
and global layers). The target drafting for itself accepts nearly every draft: the draft's own
table holds the right KV, not just a verified guess."""

from __future__ import annotations

import pytest
from tiny_windowed import TARGETS, save_tiny

from tessera import LLM, SamplingParams

NUM_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 300 + 5 for j in range(20 + 9 * i)]}
           for i in range(3)]


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request, tmp_path_factory):
    """(name, target dir, plain greedy tokens of PROMPTS)."""
    path = save_tiny(tmp_path_factory.mktemp(request.param), *TARGETS[request.param], seed=3)
    plain = _run(LLM(model=path, block_size=4, max_model_len=96))
    return request.param, path, plain


@pytest.fixture(scope="module")
def llama_draft(tmp_path_factory):
    """A random one-layer Llama with the targets' vocabulary: full attention."""
    return save_tiny(tmp_path_factory.mktemp("draft"), "LlamaConfig", "LlamaForCausalLM",
                 dict(num_hidden_layers=1), seed=4)


def _run(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _spec(model: str) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3}


def _check_pools(llm: LLM) -> None:
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.draft_group == bm.num_groups - 1 and bm.draft_gpu is not None
    assert bm.num_released_blocks > 0  # the target's window groups released
    bm.check_integrity()
    assert bm.gpu.num_free == bm.num_gpu_blocks
    assert bm.draft_gpu.num_free == bm.num_draft_gpu_blocks


def test_target_drafting_for_itself_alone_and_batched(target):
    name, path, plain = target
    llm = LLM(model=path, block_size=4, max_model_len=96, speculative_config=_spec(path))
    assert _run(llm) == plain
    assert _run(llm, PROMPTS[-1:]) == plain[-1:]
    m = llm.get_metrics()
    drafts = m["tessera:spec_decode_num_draft_tokens_total"]
    assert drafts > 0
    # the same model with its whole context: its drafts are the target's tokens
    assert m["tessera:spec_decode_num_accepted_tokens_total"] / drafts > 0.9
    _check_pools(llm)


@pytest.mark.parametrize("engine_args", [
    {"preemption_mode": "swap", "num_gpu_blocks_override": 26},
    {"preemption_mode": "recompute", "num_gpu_blocks_override": 26},
    # chunks shorter than the prompts: the tables cover one chunk past the computed tokens
    {"enable_chunked_prefill": True, "max_num_batched_tokens": 16},
], ids=["swap", "recompute", "chunked"])
def test_other_draft_keeps_greedy_output(target, llama_draft, engine_args):
    name, path, plain = target
    llm = LLM(model=path, block_size=4, max_model_len=96, speculative_config=_spec(llama_draft),
              **engine_args)
    assert _run(llm) == plain
    if "preemption_mode" in engine_args:
        assert llm.get_metrics()["tessera:num_preemptions_total"] > 0
    _check_pools(llm)


def test_without_a_window_the_draft_follows_the_target_table(llama_draft, tmp_path):
    path = save_tiny(tmp_path / "llama", "LlamaConfig", "LlamaForCausalLM",
                 dict(num_hidden_layers=2), seed=5)
    llm = LLM(model=path, block_size=4, max_model_len=96, speculative_config=_spec(llama_draft))
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.draft_group is None and bm.num_groups == 1
    assert llm.llm_engine.executor.runner.draft_proposer.own_pool_base is None
    _run(llm, PROMPTS[:1])
