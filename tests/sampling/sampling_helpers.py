"""Rows and results of the sampler, shorthand for the sampling tests."""

from tessera.sampling.params import SamplingParams
from tessera.sampling.sampler import SamplerOutput, SamplingRow

VOCAB = 64  # the `logits` fixture's (conftest.py)


def row(params=None, prompt=(1, 2, 3), output=(), **kw) -> SamplingRow:
    return SamplingRow(params or SamplingParams(), list(prompt), list(output), **kw)


def tokens(out: SamplerOutput) -> list[list[int]]:
    return [[s.token_id for s in samples] for samples in out.samples]
