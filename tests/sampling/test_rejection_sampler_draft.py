"""The general rejection rule (draft drafts sampled from q, not point masses) preserves the target's
distribution: a chi-square test through the real model runner and the real draft-model proposer,
on toy bigram models over a vocabulary of 5 whose draft distribution q differs from the target's p.

Each of 4000 seeded requests decodes x0 from the token 3 (plain sampling); the draft proposes two
tokens after it, sampled from q at temperature 0.8, top-k 4; the next step verifies them, and the
request's next two tokens (y0, y1) (from the verification, or one plain decode after it when the
first draft was rejected) must follow sum_x0 P(x0 | 3) P(y0 | x0) P(y1 | y0) under the processed
target distribution. With the acceptance or the residual rule broken on purpose, it must fail.
"""

from __future__ import annotations

import types

import pytest
import torch

import tessera.worker.model_runner as model_runner
import tessera.worker.spec_decode.verify as verify
from tessera.config import SpeculativeConfig
from tessera.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tessera.sampling.params import SamplingParams
from tessera.sampling.rejection_sampler import inverse_cdf, rejection_sample
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
from tessera.worker.spec_decode import DraftModelProposer
from tests.sampling.test_rejection_sampler import (
    TEMPERATURE,
    TOP_K,
    BigramModel,
    V,
    chi_square_p_value,
    processed,
)

NUM_REQUESTS = 4000
K = 2
DRAFT_TABLE = torch.tensor(
    [  # the draft's logits by previous token: close to the target's, not equal
        [0.4, 0.9, -0.5, 0.3, 0.2],
        [0.5, -1.0, 1.2, 0.9, 1.0],
        [0.3, 1.0, 0.0, -2.0, 1.0],
        [0.2, 0.6, 0.4, 0.4, -1.0],
        [1.0, 0.5, 0.2, -0.3, -0.7],
    ]
)


class BigramDraft(BigramModel):
    def compute_logits(self, hidden):
        return hidden @ DRAFT_TABLE


def _runner() -> model_runner.ModelRunner:
    cpu = torch.device("cpu")
    spec = KVCacheSpec(1, 1, 8, 16, torch.float32)
    no_attention = types.SimpleNamespace(
        build_metadata=lambda *args: None
    )  # toys attend to nothing
    proposer = DraftModelProposer(BigramDraft(), CacheEngine(spec, NUM_REQUESTS, 0, cpu),
                                  no_attention, 16, K, max_model_len=64, device=cpu)
    return model_runner.ModelRunner(
        BigramModel(), CacheEngine(spec, NUM_REQUESTS, 0, cpu), block_size=16, device=cpu,
        speculative_config=SpeculativeConfig(method="draft_model", model="toy",
                                             num_speculative_tokens=K),
        draft_proposer=proposer,
    )


def sample_pairs() -> tuple[dict[tuple[int, int], int], int]:
    """(counts of (y0, y1), how many requests had their first draft accepted)."""
    runner = _runner()
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=8)
    first = SchedulerOutput()
    for i in range(NUM_REQUESTS):
        req_id = f"r{i}"
        first.scheduled_new_reqs.append(NewRequestData(req_id, [0, 3], [], params, [i], 1, seed=i))
        first.num_scheduled_tokens[req_id] = 1
    out = runner.execute_model(first)
    verify = SchedulerOutput()
    for req_id, tokens, drafts in zip(out.req_ids, out.sampled_token_ids, out.spec_token_ids,
                                      strict=True):
        assert len(tokens) == 1 and len(drafts) == K
        verify.scheduled_cached_reqs.append(CachedRequestData(req_id, tokens, [], False, 2))
        verify.num_scheduled_tokens[req_id] = 1 + K
        verify.scheduled_spec_decode_tokens[req_id] = drafts
    drafted = dict(zip(out.req_ids, out.spec_token_ids, strict=True))
    out = runner.execute_model(verify)
    pairs: dict[tuple[int, int], int] = {}
    accepted = 0
    last = SchedulerOutput()
    for req_id, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
        assert 1 <= len(tokens) <= K + 1
        accepted += tokens[0] == drafted[req_id][0] and len(tokens) > 1
        if len(tokens) >= 2:
            pairs[tokens[0], tokens[1]] = pairs.get((tokens[0], tokens[1]), 0) + 1
        else:  # the first draft was rejected: one plain decode gives the second token
            last.scheduled_cached_reqs.append(CachedRequestData(req_id, tokens, [], False, 3))
            last.num_scheduled_tokens[req_id] = 1
    out = runner.execute_model(last)
    for req_id, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
        y0 = runner.requests[req_id].output_token_ids[1]
        pairs[y0, tokens[0]] = pairs.get((y0, tokens[0]), 0) + 1
    assert sum(pairs.values()) == NUM_REQUESTS
    return pairs, accepted


def expected_pairs() -> dict[tuple[int, int], float]:
    p0 = processed(3)
    py0 = sum(p0[x] * processed(x) for x in range(V))  # [V] marginal of y0
    return {(a, b): NUM_REQUESTS * float(py0[a] * processed(a)[b])
            for a in range(V) for b in range(V)}


def test_general_rejection_preserves_the_target_distribution():
    pairs, accepted = sample_pairs()
    assert 0.2 * NUM_REQUESTS < accepted < 0.9 * NUM_REQUESTS  # drafts accepted and rejected
    assert chi_square_p_value(pairs, expected_pairs()) > 1e-4


def _accept_all(p, q, drafts, u):
    return len(drafts), inverse_cdf(p[len(drafts)], float(u[len(drafts), 2]))


def _residual_from_p(p, q, drafts, u):
    a, _ = rejection_sample(p, q, drafts, u)
    return a, inverse_cdf(p[a], float(u[a, 2]))  # on rejection, p itself: d is over-represented


def _inverted_ratio(p, q, drafts, u):  # accepts with min(1, q/p) instead of min(1, p/q)
    m = len(drafts)
    swapped = torch.cat([q, p[m:]])  # q in p's place: accept while u * p(d) < q(d)
    a, _ = rejection_sample(swapped, p[:m], drafts, u)
    if a == m:
        return a, inverse_cdf(p[m], float(u[m, 2]))
    return a, inverse_cdf((p[a] - q[a]).clamp(min=0), float(u[a, 2]))


@pytest.mark.parametrize("broken", [_accept_all, _residual_from_p, _inverted_ratio],
                         ids=lambda f: f.__name__)
def test_a_broken_rule_is_caught(monkeypatch, broken):
    monkeypatch.setattr(verify, "rejection_sample", broken)
    pairs, _ = sample_pairs()
    assert chi_square_p_value(pairs, expected_pairs()) < 1e-6


def test_equal_distributions_accept_every_draft():
    p = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]])
    u = torch.rand(3, 3)
    u[:, 1] = 0.999  # even the largest acceptance draw
    assert rejection_sample(p, p[:2], [1, 0], u)[0] == 2
    # a draft the target gives probability 0 is always rejected, and never resampled
    q = torch.tensor([[0.0, 0.0, 1.0]])
    p0 = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    u = torch.zeros(2, 3)
    a, tok = rejection_sample(p0, q, [2], u)
    assert a == 0 and tok == 0
