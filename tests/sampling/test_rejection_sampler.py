"""Speculative verification preserves the target's distribution: a chi-square test through the real
model runner on a toy bigram "model" (vocabulary 5), whose next-token distribution depends on the
previous token, so a wrong acceptance shows up in what follows it.

Each of 4000 seeded requests decodes from the token 3 with two drafts [1, 2] (the drafted token 1
is likely but not certain), at temperature 0.8 with top-k 4, and yields its next two tokens (from
the verification step, or from one plain decode after it when the first draft was rejected). The
pair must follow P(x0 | 3) * P(x1 | x0) under the *processed* target distribution. With the
acceptance rule broken on purpose, the same test must fail.
"""

from __future__ import annotations

import math

import pytest
import torch

import tessera.worker.model_runner as model_runner
from tessera.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tessera.sampling.params import SamplingParams
from tessera.sampling.rejection_sampler import num_accepted
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec

V = 5
TABLE = torch.tensor([  # logits of the next token, by previous token
    [1.0, 0.2, -0.5, 0.3, 0.0],
    [0.0, -1.0, 2.0, 0.5, 1.0],
    [0.3, 0.3, 0.3, -2.0, 1.5],
    [0.0, 1.2, -0.3, 0.4, -1.0],
    [1.5, 0.0, 0.2, 0.2, -0.7],
])
TEMPERATURE, TOP_K = 0.8, 4
NUM_REQUESTS = 4000
DRAFTS = [1, 2]


class BigramModel:
    """The runner's model interface; each position's logits depend only on its input token."""

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        return torch.nn.functional.one_hot(input_ids, V).float()  # [num_tokens, V]

    def compute_logits(self, hidden):
        return hidden @ TABLE


def processed(prev: int) -> torch.Tensor:
    """The target distribution after temperature and top-k, as the sampler applies them."""
    p = (TABLE[prev] / TEMPERATURE).softmax(-1)
    p[p.argsort()[: V - TOP_K]] = 0
    return p / p.sum()


def chi_square_p_value(observed: dict, expected: dict) -> float:
    """P(X >= statistic) for X ~ chi-square with (cells - 1) degrees of freedom; 0 if a cell of
    probability 0 was observed."""
    cells = [c for c in expected if expected[c] > 0]
    if any(n for c, n in observed.items() if c not in cells):
        return 0.0
    stat = sum((observed.get(c, 0) - expected[c]) ** 2 / expected[c] for c in cells)
    s, x = (len(cells) - 1) / 2, stat / 2
    # regularized lower incomplete gamma by its series; the p-value is its complement
    term = total = 1.0 / s
    n = 1
    while term > 1e-16 * total:
        term *= x / (s + n)
        total += term
        n += 1
    return max(0.0, 1.0 - math.exp(s * math.log(x) - x - math.lgamma(s)) * total) if x > 0 else 1.0


def sample_pairs() -> dict[tuple[int, int], int]:
    runner = model_runner.ModelRunner(
        BigramModel(), CacheEngine(KVCacheSpec(1, 1, 8, 16, torch.float32), NUM_REQUESTS, 0,
                                      torch.device("cpu")),
        block_size=16, device=torch.device("cpu"),
    )
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=8)
    step = SchedulerOutput()
    for i in range(NUM_REQUESTS):
        req_id = f"r{i}"
        step.scheduled_new_reqs.append(NewRequestData(req_id, [0, 3], [], params, [i], 1, seed=i))
        step.num_scheduled_tokens[req_id] = 1 + len(DRAFTS)
        step.scheduled_spec_decode_tokens[req_id] = list(DRAFTS)
    out = runner.execute_model(step)
    pairs: dict[tuple[int, int], int] = {}
    second = SchedulerOutput()
    for req_id, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
        assert 1 <= len(tokens) <= len(DRAFTS) + 1
        if len(tokens) >= 2:
            pairs[tokens[0], tokens[1]] = pairs.get((tokens[0], tokens[1]), 0) + 1
        else:  # the first draft was rejected: one plain decode gives the second token
            second.scheduled_cached_reqs.append(CachedRequestData(req_id, tokens, [], False, 2))
            second.num_scheduled_tokens[req_id] = 1
    out = runner.execute_model(second)
    for req_id, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
        first = runner.requests[req_id].output_token_ids[0]
        pairs[first, tokens[0]] = pairs.get((first, tokens[0]), 0) + 1
    assert sum(pairs.values()) == NUM_REQUESTS
    return pairs


def expected_pairs() -> dict[tuple[int, int], float]:
    p0 = processed(3)
    return {
        (a, b): NUM_REQUESTS * float(p0[a] * processed(a)[b]) for a in range(V) for b in range(V)
    }


def test_verification_preserves_the_target_distribution():
    pairs = sample_pairs()
    accepted = sum(n for (a, _), n in pairs.items() if a == DRAFTS[0])
    assert 0.2 * NUM_REQUESTS < accepted < 0.8 * NUM_REQUESTS  # drafts both accepted and rejected
    assert chi_square_p_value(pairs, expected_pairs()) > 1e-4


@pytest.mark.parametrize("broken", ["accept_all", "one_too_many"])
def test_a_broken_acceptance_rule_is_caught(monkeypatch, broken):
    rules = {
        "accept_all": lambda sampled, drafts: len(drafts),
        "one_too_many": lambda sampled, drafts: min(len(drafts), num_accepted(sampled, drafts) + 1),
    }
    monkeypatch.setattr(model_runner, "num_accepted", rules[broken])
    assert chi_square_p_value(sample_pairs(), expected_pairs()) < 1e-6


def test_chi_square_p_value():
    # df = 1: P(X >= 3.841) = 0.05; df = 4: P(X >= 9.488) = 0.05
    exp1 = {0: 50.0, 1: 50.0}
    assert chi_square_p_value({0: 50 + 9.8, 1: 50 - 9.8}, exp1) == pytest.approx(0.05, abs=2e-3)
    exp4 = {i: 100.0 for i in range(5)}
    obs = {0: 100 + 15.4, 1: 100 - 15.4, 2: 100 + 15.4, 3: 100 - 15.4, 4: 100.0}
    assert chi_square_p_value(obs, exp4) == pytest.approx(0.05, abs=3e-3)
