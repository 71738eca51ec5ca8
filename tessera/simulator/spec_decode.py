"""Speculative decoding in the simulator: an acceptance-rate model for the synthetic runner.

With `--speculative-config`, the synthetic runner plays the proposer and the verifier:

- after a step, every request that sampled one token gets `num_speculative_tokens` drafts (none
  when the step ran `disable_by_batch_size` requests or more, the runner's rule), and the real
  scheduler trims and schedules them as it does on the server: 1 + k new tokens;
- a verification step returns 1 + the accepted drafts, drawn from `GeometricAcceptance`: each
  draft is accepted with probability `rate` if every draft before it was (the first rejection
  ends the run, as the rejection sampler's does), so a step of k drafts returns on average

      E[tokens] = (1 - rate^(k + 1)) / (1 - rate)

  (Leviathan et al., ICML 2023, eq. 1). The rate is the server's measured acceptance,
  `tessera:spec_decode_num_accepted_tokens_total / tessera:spec_decode_num_draft_tokens_total`
  (per draft: the first positions accept more often; a single rate is the model's choice).

The verification step's cost is the cost model's price of its batch: 1 + k query tokens after the
request's cached context, as the runner computes them (`BatchShape` counts them with the prefill
tokens and their attention pairs). Proposing is free: the ngram proposer is a lookup of
microseconds; draft-model passes are not modelled (refused in cli.py), nor the runner's adaptive
draft length (the simulator always drafts the configured k).
"""

from __future__ import annotations

import random


class GeometricAcceptance:
    """Drafts accepted one by one with probability `rate`, until the first rejection; seeded,
    so a simulation repeats."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"--spec-acceptance-rate must be in [0, 1), got {rate}")
        self.rate = rate
        self._rng = random.Random(seed)

    def num_tokens_returned(self, req_id: str, num_draft_tokens: int) -> int:
        accepted = 0
        rand = self._rng.random
        while accepted < num_draft_tokens and rand() < self.rate:
            accepted += 1
        return accepted + 1

    def mean_tokens_returned(self, num_draft_tokens: int) -> float:
        """E[tokens per verification step] for k drafts."""
        r = self.rate
        return (1 - r ** (num_draft_tokens + 1)) / (1 - r)
