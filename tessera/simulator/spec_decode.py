"""Speculative decoding in the simulator: an acceptance-rate model for the synthetic runner.

With `--speculative-config`, the synthetic runner plays the proposer and the verifier:

- after a step, a request that sampled one token gets `num_speculative_tokens` drafts with
  probability `proposal_rate` (prompt lookup finds no match on the other steps; none at all when
  the running batch holds `disable_by_batch_size` requests or more, the runner's rule), and the real
  scheduler trims and schedules them as it does on the server: 1 + k new tokens;
- a verification step returns 1 + the accepted drafts, drawn from `GeometricAcceptance`: each
  draft is accepted with a conditional probability `alpha` if every draft before it was (the
  first rejection ends the run, as the rejection sampler's does), so a step of k drafts returns

      E[tokens] = (1 - alpha^(k + 1)) / (1 - alpha)     (Leviathan et al., ICML 2023, eq. 1)

Both inputs are what the server counts (tessera/engine/metrics.py): the acceptance is
`spec_decode_num_accepted_tokens_total / spec_decode_num_draft_tokens_total`, the fraction of
drafts accepted, E[accepted] / k = alpha (1 - alpha^k) / ((1 - alpha) k), from which alpha is
solved (bisection: the fraction grows with alpha). README's A1 workload, 60.9% at k = 4, is
alpha = 0.81 and 3.44 tokens per verification step, as measured there. The proposal rate is
`spec_decode_num_drafts_total` over the decode steps of requests.

The verification step's cost is the cost model's price of its batch: 1 + k query tokens after the
request's cached context, as the runner computes them (`BatchShape` counts them with the prefill
tokens and their attention pairs). Proposing is free: the ngram proposer is a lookup of
microseconds (README: 0.5% of a step); draft-model passes are not modelled (refused in cli.py),
nor the runner's adaptive draft length (the simulator always drafts the configured k).
"""

from __future__ import annotations

import random

from tessera.simulator.fit import bisect_increasing


def conditional_rate(acceptance: float, num_draft_tokens: int) -> float:
    """The per-position alpha whose expected fraction of accepted drafts (out of k) is
    `acceptance`."""
    k = num_draft_tokens
    if acceptance >= 1.0:
        return 1.0

    def fraction(a: float) -> float:
        return sum(a ** j for j in range(1, k + 1)) / k

    return bisect_increasing(fraction, acceptance, 0.0, 1.0, iters=60)


class GeometricAcceptance:
    """Drafts accepted one by one with conditional probability alpha until the first rejection,
    alpha solved from the measured `acceptance` at `num_draft_tokens`; drafts proposed with
    probability `proposal_rate`. Seeded, so a simulation repeats."""

    def __init__(self, acceptance: float, num_draft_tokens: int, proposal_rate: float = 1.0,
                 seed: int = 0) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"--spec-acceptance-rate must be in [0, 1], got {acceptance}")
        if not 0.0 < proposal_rate <= 1.0:
            raise ValueError(f"--spec-proposal-rate must be in (0, 1], got {proposal_rate}")
        self.acceptance = acceptance
        self.alpha = conditional_rate(acceptance, num_draft_tokens)
        self.proposal_rate = proposal_rate
        self._rng = random.Random(seed)

    def proposes(self, req_id: str) -> bool:
        """Whether the proposer finds drafts for `req_id` after this step."""
        return self.proposal_rate >= 1.0 or self._rng.random() < self.proposal_rate

    def num_tokens_returned(self, req_id: str, num_draft_tokens: int) -> int:
        accepted = 0
        rand = self._rng.random
        while accepted < num_draft_tokens and rand() < self.alpha:
            accepted += 1
        return accepted + 1

    def mean_tokens_returned(self, num_draft_tokens: int) -> float:
        """E[tokens per verification step] for k drafts."""
        a = self.alpha
        return (
            float(num_draft_tokens + 1) if a >= 1.0 else (1 - a ** (num_draft_tokens + 1)) / (1 - a)
        )
