"""What the sampler takes and gives back, a row at a time: plain data passed between the model
runner, the sampler (sampler.py) and speculative verification (worker/spec_decode)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.sampling.grammar import GrammarState
from tessera.sampling.params import SamplingParams


@dataclass
class SamplingRow:
    """One row of logits and what the sampler needs to know about its sequence."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # for penalties and min_tokens
    # n when a prompt just completed and the engine will fork n-1 children from this row
    num_samples: int = 1
    # required when params.seed is set; may live on another device than the logits (noise is moved)
    generator: torch.Generator | None = None
    # masked (with params.stop_token_ids) while len(output_token_ids) < params.min_tokens
    eos_token_ids: tuple[int, ...] = ()
    # the sequence's place in its structured-output grammar (None: unconstrained)
    grammar: GrammarState | None = None


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # of token_id under the raw distribution (see `Sampler`)
    # params.logprobs top alternatives plus the chosen token; None when params.logprobs is None
    top_logprobs: dict[int, float] | None = None


@dataclass
class SamplerOutput:
    samples: list[list[SampledToken]]  # per row, row.num_samples entries
