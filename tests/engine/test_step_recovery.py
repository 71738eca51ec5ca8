"""A step that raises hurts only the request that caused it (engine/step_recovery.py): a fault
injected into the sampler for one chosen request fails that request alone, mid-generation; every
other request, greedy or seeded, gets exactly the tokens it gets without the faulty neighbour."""

from __future__ import annotations

import pytest

from tessera.sampling.params import SamplingParams
from tessera.sampling.sampler import Sampler

POISON = [9, 8, 7, 6, 5, 4, 3, 2]  # the chosen request's prompt (token ids)
PROMPTS = [
    {"prompt_token_ids": [1, 415, 5093, 302, 4843, 349]},
    {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]},
    {"prompt_token_ids": [50, 60, 70]},
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=2**64 - 1, n=2, max_tokens=6, ignore_eos=True)
PARAMS = [GREEDY, SEEDED, GREEDY]


def _inject(monkeypatch, when) -> list[int]:
    """Make the sampler raise, after sampling, whenever `when(row)` holds for one of its rows;
    returns a list that counts the faults raised."""
    original = Sampler._sample_rows
    faults: list[int] = []

    def faulty(self, logits, rows):
        out = original(self, logits, rows)  # raise late: the seeded rows have drawn already
        if any(when(r) for r in rows):
            faults.append(1)
            raise RuntimeError("injected fault")
        return out

    monkeypatch.setattr(Sampler, "_sample_rows", faulty)
    return faults


def _tokens(out):
    return [o.token_ids for o in sorted(out.outputs, key=lambda o: o.index)]


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(kv_cache_space=0.1)  # 2,300 tokens: plenty, and quick to allocate


@pytest.fixture(scope="module")
def reference(llm):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [_tokens(o) for o in outs]


@pytest.mark.parametrize("prefix_caching", [
    False, pytest.param(True, marks=pytest.mark.heavy)])
def test_only_the_culprit_fails(make_llm, llm, monkeypatch, reference, prefix_caching):
    if prefix_caching:
        llm = make_llm(kv_cache_space=0.1, enable_prefix_caching=True)
    # the poisoned request fails on its 3rd token: it has been running (cached in the runner's
    # persistent batch) for two steps beside the others
    faults = _inject(monkeypatch, lambda r: r.prompt_token_ids == POISON
                     and len(r.output_token_ids) == 2)
    outs = llm.generate(PROMPTS[:2] + [{"prompt_token_ids": POISON}] + PROMPTS[2:],
                        PARAMS[:2] + [GREEDY] + PARAMS[2:], use_tqdm=False)
    assert faults, "the fault was never injected"
    victim = outs.pop(2)
    assert victim.finished and victim.failed and victim.outputs == []
    assert "engine failed while running this request" in victim.error
    assert [_tokens(o) for o in outs] == reference
    assert all(not o.failed and o.error is None for o in outs)
    metrics = llm.get_metrics()
    assert metrics["tessera:kv_cache_usage_perc"] == 0.0 or prefix_caching
    assert metrics["tessera:num_requests_running"] == 0
    # the engine goes on serving after the fault
    monkeypatch.undo()
    assert _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]) == reference[0]


def test_transient_fault_fails_nobody_and_a_broken_step_fails_everyone(
        llm, monkeypatch, reference):
    faults = _inject(monkeypatch, lambda r: len(r.output_token_ids) == 2 and not faults)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert len(faults) == 1
    assert [_tokens(o) for o in outs] == reference and not any(o.failed for o in outs)
    # a fault for every request (a broken device): every request fails, nothing hangs or leaks
    _inject(monkeypatch, lambda r: True)
    outs = llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)
    assert len(outs) == 2 and all(o.failed for o in outs)
    assert llm.get_metrics()["tessera:kv_cache_usage_perc"] == 0.0


def test_merge_outputs_keeps_rows_aligned():
    """Halves re-run apart merge into one output whose per-row lists (tokens, logprobs, drafts)
    stay aligned with req_ids, also when only one half has logprobs or drafts."""
    from tessera.core.runner_output import ModelRunnerOutput
    from tessera.engine.step_recovery import merge_outputs

    a = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[1]], logprobs=[[{1: -0.5}]],
                          spec_token_ids=[[7, 8]])
    b = ModelRunnerOutput(req_ids=["b", "c"], sampled_token_ids=[[2], [3, 4]])
    m = merge_outputs([a, b])
    assert m.req_ids == ["a", "b", "c"] and m.sampled_token_ids == [[1], [2], [3, 4]]
    assert m.logprobs == [[{1: -0.5}], [], []]
    assert m.spec_token_ids == [[7, 8], [], []]
    assert merge_outputs([b]).spec_token_ids == []
