"""Speculative decoding (n-gram prompt lookup) is lossless: greedy output is identical to greedy
without it, alone, batched with requests that find nothing to propose, under preemption (swap and
recompute), chunked prefill, prefix caching, and with n > 1; seeded sampling (penalties, top-p,
logprobs) draws the very same tokens; stop rules fire inside an accepted run.

Prompts: half repeat a random passage and stop midway, so the model's induction copies the rest and
the proposer's drafts are mostly accepted; half are random tokens, where it proposes little. Every
test also checks that speculation really happened (drafts verified, some accepted, some not).
"""

from __future__ import annotations

import numpy as np
import pytest

from tessera import SamplingParams

NUM_TOKENS = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def _prompts() -> list[dict]:
    rng = np.random.default_rng(11)
    out = []
    for i in range(4):
        if i % 2 == 0:  # a passage, then its first part again: the model goes on copying
            seg = rng.integers(100, 20000, 40).tolist()
            out.append({"prompt_token_ids": seg + seg[:12]})
        else:
            out.append(
                {"prompt_token_ids": rng.integers(100, 20000, int(rng.integers(30, 60))).tolist()}
            )
    return out


PROMPTS = _prompts()
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _run(llm, params=GREEDY, prompts=PROMPTS, one_by_one=False):
    if one_by_one:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _speculated(llm) -> tuple[float, float]:
    """(draft tokens verified, accepted); asserts some were and some were not accepted."""
    m = llm.get_metrics()
    drafts = m["tessera:spec_decode_num_draft_tokens_total"]
    accepted = m["tessera:spec_decode_num_accepted_tokens_total"]
    assert m["tessera:spec_decode_num_drafts_total"] > 0
    assert 0 < accepted < drafts, (accepted, drafts)
    return drafts, accepted


@pytest.fixture(scope="module")
def llm_factory(make_llm):
    """Engines with a small cache unless a test sets one (allocating 1 GiB per engine is slow)."""
    def make(**engine_args):
        engine_args.setdefault("num_gpu_blocks_override", 64)
        return make_llm(**engine_args)
    return make


@pytest.fixture(scope="module")
def baseline(llm_factory):
    return _run(llm_factory())


def test_greedy_identical_batched(llm_factory, baseline):
    llm = llm_factory(speculative_config=NGRAM)
    assert _run(llm) == baseline
    drafts, accepted = _speculated(llm)
    m = llm.get_metrics()
    per_pos = [m[f'tessera:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}']
               for i in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    # accepted drafts are tokens the engine did not have to decode one by one
    num_steps = llm.llm_engine.step_times.num_steps
    assert num_steps < len(PROMPTS) * NUM_TOKENS


def test_greedy_identical_alone(llm_factory, baseline):
    llm = llm_factory(speculative_config=NGRAM)
    assert _run(llm, prompts=PROMPTS[:2], one_by_one=True) == baseline[:2]
    _speculated(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_identical_under_preemption(llm_factory, baseline, mode):
    # 14 blocks of 8 hold one 112-token request (the engine's start-up rule), not all four
    llm = llm_factory(speculative_config=NGRAM, num_gpu_blocks_override=14, preemption_mode=mode,
                      block_size=8, max_model_len=112)
    assert _run(llm) == baseline
    assert llm.get_metrics()["tessera:num_preemptions_total"] > 0
    _speculated(llm)


def test_greedy_identical_chunked_prefill_and_prefix_caching(llm_factory, baseline):
    llm = llm_factory(speculative_config=NGRAM, enable_chunked_prefill=True,
                   max_num_batched_tokens=40, enable_prefix_caching=True)
    assert _run(llm) == baseline
    assert _run(llm) == baseline  # the second run hits the prefix cache
    assert llm.get_metrics()["tessera:prefix_cache_hits_total"] > 0
    _speculated(llm)


def test_seeded_sampling_draws_the_same_tokens(llm_factory):
    """The verifier draws each emitted token with the draw a plain decode makes at that position
    (tessera/sampling/rejection_sampler.py), so a seeded request's tokens, n > 1 children and
    logprobs included, do not change with speculation."""
    params = [SamplingParams(temperature=0.5, top_p=0.95, top_k=50, seed=100 + i, n=2, logprobs=2,
                             presence_penalty=0.1, frequency_penalty=0.2,
                             max_tokens=NUM_TOKENS, ignore_eos=True) for i in range(len(PROMPTS))]

    def run(llm):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [[(c.token_ids, [sorted(d.items()) for d in c.logprobs]) for c in o.outputs]
                for o in outs]

    base = run(llm_factory())
    llm = llm_factory(speculative_config=NGRAM)
    got = run(llm)
    for b, g in zip(base, got, strict=True):
        for (bt, blp), (gt, glp) in zip(b, g, strict=True):
            assert bt == gt
            assert [[i for i, _ in d] for d in blp] == [[i for i, _ in d] for d in glp]
            np.testing.assert_allclose(
                [v for d in blp for _, v in d], [v for d in glp for _, v in d], rtol=1e-4, atol=1e-4
            )
    _speculated(llm)


def test_stops_inside_an_accepted_run(llm_factory, baseline):
    """A stop token id, a stop string's end and max_tokens all land where they would without
    speculation, even when the token that stops sits inside a run of accepted drafts."""
    stop_id = baseline[2][0][9]  # prompt 2 copies its passage
    cases = [
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, min_tokens=12,
                       stop_token_ids=[stop_id]),
    ]
    plain, llm = llm_factory(), llm_factory(speculative_config=NGRAM)
    for params in cases:
        base = _run_params(plain, params)
        got = _run_params(llm, params)
        assert got == base, params
        assert all(len(t) <= params.max_tokens for t in got)
    assert len(_run_params(plain, cases[0])[2]) == 10  # the stop id ended the copied run
    _speculated(llm)


def _run_params(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_disable_by_batch_size(llm_factory, baseline):
    llm = llm_factory(speculative_config={**NGRAM, "disable_by_batch_size": 1})
    assert _run(llm) == baseline
    assert llm.get_metrics()["tessera:spec_decode_num_drafts_total"] == 0
    # with 4 requests running nothing is proposed; alone, each speculates
    llm = llm_factory(speculative_config={**NGRAM, "disable_by_batch_size": 3})
    assert _run(llm) == baseline
    assert llm.get_metrics()["tessera:spec_decode_num_drafts_total"] == 0
    assert _run(llm, prompts=PROMPTS[:1]) == baseline[:1]
    assert llm.get_metrics()["tessera:spec_decode_num_drafts_total"] > 0


def test_metrics_served_at_prometheus_names(llm_factory):
    from tessera.engine.metrics import ServerMetrics

    llm = llm_factory(speculative_config=NGRAM)
    _run(llm, prompts=PROMPTS[:1])
    text = ServerMetrics(llm.get_metrics).render().decode()
    label = 'model_name="tessera"'
    for name in (f"tessera:spec_decode_num_drafts_total{{{label}}}",
                 f"tessera:spec_decode_num_draft_tokens_total{{{label}}}",
                 f"tessera:spec_decode_num_accepted_tokens_total{{{label}}}",
                 f'tessera:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="0"}}',
                 f'tessera:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="3"}}'):
        assert f"\n{name} " in text, name
    assert "spec_decode" not in ServerMetrics(llm_factory().get_metrics).render().decode()


def test_bf16_greedy_identical(default_model_path):
    """bf16 too: exact equality, batched, under preemption and with chunked prefill (every CPU
    kernel computes a row the same way whatever else is in the step, verification rows included)."""
    import torch

    from tessera.config import EngineArgs
    from tessera.engine.llm_engine import LLMEngine
    from tessera.engine.loading import load_bundle
    from tessera.entrypoints.llm import LLM
    from tessera.kernels.fused import fused_ops_for
    from tessera.kernels.linear import linear_kernel_supported
    from tessera.kernels.paged_attention import paged_attention_available

    cpu = torch.device("cpu")
    if not (linear_kernel_supported(torch.zeros(32, 32, dtype=torch.bfloat16))
            and fused_ops_for(cpu, torch.bfloat16) is not None
            and paged_attention_available(cpu, torch.bfloat16)):
        pytest.skip("bf16 invariance rests on the C++ kernels, not built here")
    bundle = load_bundle(EngineArgs(dtype="bfloat16", max_model_len=512))

    def make(**engine_args):
        engine_args.setdefault("num_gpu_blocks_override", 64)
        engine_args.setdefault("max_model_len", 512)
        args = EngineArgs(dtype="bfloat16", **engine_args)
        return LLM.from_engine(LLMEngine.from_engine_args(args, bundle=bundle))

    base = _run(make())
    llm = make(speculative_config=NGRAM)
    assert _run(llm) == base
    _speculated(llm)
    small = make(speculative_config=NGRAM, num_gpu_blocks_override=14, block_size=8,
                 max_model_len=112, preemption_mode="recompute", enable_chunked_prefill=True,
                 max_num_batched_tokens=40)
    assert _run(small) == base
    assert small.get_metrics()["tessera:num_preemptions_total"] > 0
    _speculated(small)
