"""The widened top-k/top-p/min-p filter against a naive reference that sorts the whole vocabulary.

The sampler filters only the top 64 (then 1024) candidates and widens for rows whose kept set may
reach past them (`sample_random`, `apply_filters` in tessera/sampling/random_draws.py). The
reference here sorts everything and applies top-k, then top-p on the top-k-renormalised
distribution (a token stays while the mass strictly above it is below top_p; top_p == 1 is off),
then min-p (p >= min_p * p_max), always keeping the most likely token: vLLM's order and tie
rules.

Kept sets are compared by sorted position, so tied tokens (which either side may order
differently) compare equal by value. The reference works in float64 and the sampler in float32:
a position whose top-p or min-p test lies within rounding of its threshold may go either way.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tessera.sampling.random_draws as draws_mod
from tessera.sampling.params import SamplingParams
from tessera.sampling.random_draws import apply_filters, inverse_cdf
from tessera.sampling.sampler import Sampler, SamplingRow

_TOL = 2e-6  # relative rounding of float32 thresholds (top_p, min_p and the prefix sums)


def reference_prefix(sorted_probs: torch.Tensor, p: SamplingParams) -> tuple[int, int]:
    """Kept prefix of `sorted_probs` [V] (descending): (shortest, longest) length it may have.

    The two differ only where a threshold test is within rounding; both count only tokens of
    nonzero probability (a zero-probability token is never drawn, kept or not).
    """
    v = sorted_probs.double()
    n = len(v)
    keep = torch.arange(n) < (p.top_k if 0 < p.top_k < n else n)  # top-k: [V]
    sure, maybe = keep.clone(), keep.clone()
    if p.top_p < 1.0:
        mass = v * keep
        total = mass.sum()
        above = mass.cumsum(0) - mass  # mass strictly above each token
        thr = p.top_p * total
        sure &= above < thr - _TOL * total
        maybe &= above < thr + _TOL * total
    if p.min_p > 0.0:
        thr = p.min_p * v[0]
        sure &= v >= thr + _TOL * v[0]
        maybe &= v >= thr - _TOL * v[0]
    sure[0] = maybe[0] = True  # the most likely token always stays
    positive = int((v > 0).sum())

    def prefix(mask: torch.Tensor) -> int:
        dropped = (~mask).nonzero()
        return min(n if len(dropped) == 0 else int(dropped[0]), positive)

    return prefix(sure), prefix(maybe)


def kept_prefix(weights: torch.Tensor, cand: torch.Tensor) -> int:
    """Length of the kept prefix in the sampler's `weights` [K]; asserts it is exactly a prefix
    of `cand` [K] (each weight is its candidate's probability or 0, nonzero ones first)."""
    nonzero = weights.nonzero()
    n = 0 if len(nonzero) == 0 else int(nonzero[-1]) + 1
    assert torch.equal(weights[:n], cand[:n]), "kept weights are not the candidates' probabilities"
    return n


@st.composite
def logits_rows(draw, num_rows: int, max_vocab: int = 3000) -> torch.Tensor:
    """[num_rows, vocab] logits: flat, peaked or in between, optionally rounded to make ties."""
    vocab = draw(st.sampled_from([1, 2, 5, 63, 64, 65, 200, 1023, 1025, max_vocab])
                 | st.integers(1, max_vocab))
    scale = draw(st.sampled_from([0.0, 1e-3, 0.05, 0.3, 1.0, 3.0, 10.0, 40.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(num_rows, vocab, generator=gen) * scale
    if draw(st.booleans()):
        logits = logits.round()  # many exact ties (all of them when scale is small)
    if draw(st.booleans()):  # a few clear favourites over a flat tail
        logits[:, : draw(st.integers(1, 5))] += draw(st.sampled_from([0.5, 3.0, 12.0]))
    return logits


@st.composite
def filter_params(draw, sorted_probs: torch.Tensor, boundaries: bool) -> SamplingParams:
    """Random top_k/top_p/min_p; with `boundaries`, also values sitting exactly on a threshold
    (the prefix mass above a token, or a token's ratio to the most likely one)."""
    vocab = len(sorted_probs)
    top_k = draw(st.sampled_from([0, -1, 1, 2, 63, 64, 65, 1023, 1024, 1025, vocab, vocab + 1])
                 | st.integers(1, vocab + 2))
    top_p = draw(st.just(1.0) | st.floats(1e-9, 1.0))
    min_p = draw(st.just(0.0) | st.floats(0.0, 1.0))
    if boundaries:
        j = draw(st.integers(0, vocab - 1))
        at_p = float(sorted_probs[:j].double().sum())
        at_min = float(sorted_probs[j] / sorted_probs[0])
        if draw(st.booleans()) and 0 < at_p <= 1:
            top_p = at_p
        if draw(st.booleans()) and 0 <= at_min <= 1:
            min_p = at_min
    return SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_filter_on_the_first_candidates_matches_the_full_sort(data):
    """Whenever `apply_filters` calls a row resolved from its first K candidates, the kept
    prefix is the full-sort reference's; given every candidate, it always resolves."""
    num_rows = data.draw(st.integers(1, 4))
    logits = data.draw(logits_rows(num_rows))
    vocab = logits.shape[1]
    probs = logits.softmax(dim=-1).sort(dim=-1, descending=True).values  # [R, V]
    params = [data.draw(filter_params(probs[i], boundaries=True)) for i in range(num_rows)]
    ks = {min(k, vocab) for k in (1, 64, 1024, vocab)} | {data.draw(st.integers(1, vocab))}
    for k in sorted(ks):
        cand = probs[:, :k]
        kept, resolved = apply_filters(cand, params, vocab, probs.sum(dim=-1))
        for i, p in enumerate(params):
            if not resolved[i]:
                assert k < vocab, "the complete vocabulary must resolve every row"
                continue
            lo, hi = reference_prefix(probs[i], p)
            n = kept_prefix(kept[i], cand[i])
            assert lo <= n <= hi, (f"row {i} ({p.top_k=}, {p.top_p=}, {p.min_p=}) resolved at "
                                   f"K={k} of {vocab}: kept {n}, reference keeps {lo}..{hi}")


# Fixed uniforms for the inverse-CDF draw: a grid, the extremes, and the top end (which picks
# the last kept token, so an extra tail token of relative mass above 2**-40 changes it).
_GRID = torch.cat([torch.tensor([0.0]), (torch.arange(199, dtype=torch.float64) + 0.5) / 199,
                   torch.tensor([1 - 2**-20, 1 - 2**-40])])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_sampler_draws_from_the_full_sort_reference(data):
    """The whole Sampler, several rows at once, draws with fixed uniforms the same token (by
    probability, so ties compare equal) as the inverse CDF over the reference's kept prefix."""
    num_rows = data.draw(st.integers(1, 5))
    logits = data.draw(logits_rows(num_rows))
    vocab = logits.shape[1]
    temps = [data.draw(st.sampled_from([0.0, 0.4, 1.0, 1.7])) for _ in range(num_rows)]
    inv_temp = torch.tensor([1.0 / t if t else 1.0 for t in temps])
    probs = (logits * inv_temp[:, None]).softmax(dim=-1)  # as the sampler computes them
    sorted_probs = probs.sort(dim=-1, descending=True).values
    params = []
    for i, t in enumerate(temps):
        p = data.draw(filter_params(sorted_probs[i], boundaries=False))
        params.append(SamplingParams(temperature=t, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                                     n=len(_GRID)))
    rows = [SamplingRow(p, [1], [], num_samples=len(_GRID)) for p in params]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(draws_mod, "_uniforms", lambda rs, device: _GRID.repeat(len(rs)))
        out = Sampler()(logits, rows)

    for i, p in enumerate(params):
        got = [s.token_id for s in out.samples[i]]
        if p.is_greedy:
            assert got == [int(logits[i].argmax())] * len(_GRID)
            continue
        if not (0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0):
            # no filter: the draw is over the whole distribution in token-id order
            want = inverse_cdf(probs[i].expand(len(_GRID), vocab), _GRID).tolist()
            assert got == want, f"row {i}: unfiltered draw differs"
            continue
        lo, hi = reference_prefix(sorted_probs[i], p)
        if lo != hi:
            continue  # a threshold within rounding; the filter test covers such rows
        weights = sorted_probs[i].double() * (torch.arange(vocab) < lo)
        want = inverse_cdf(weights.expand(len(_GRID), vocab), _GRID)
        assert probs[i, got].tolist() == sorted_probs[i, want].tolist(), (
            f"row {i} ({p.top_k=}, {p.top_p=}, {p.min_p=}, vocab {vocab}, reference keeps {lo})")


def test_boundary_rules():
    """Exact (binary) values on each threshold: top_p drops a token whose mass above equals top_p,
    min_p keeps a token at exactly min_p * p_max, top_k keeps k of tied tokens, a top_p too small
    for any token still keeps the most likely one, and top_p applies to the top-k mass (0.6 of
    0.75 is 0.45 < 0.5: one token; of the whole distribution it would keep two)."""
    cand = torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 5)
    params = [SamplingParams(top_p=0.75), SamplingParams(min_p=0.25), SamplingParams(top_k=3),
              SamplingParams(top_p=1e-9), SamplingParams(top_k=2, top_p=0.6)]
    kept, resolved = apply_filters(cand, params, 4)
    assert resolved.all()
    assert [kept_prefix(w, c) for w, c in zip(kept, cand, strict=True)] == [2, 4, 3, 1, 1]


def test_top_p_applies_to_a_top_k_past_the_first_candidates():
    # flat over 200: top_k=65 leaves a mass of 0.325, and top_p=0.25 of that (0.08125) keeps 17
    # tokens. Against the whole distribution (a bug once, when top_k > 64) it would keep 50.
    lg = torch.zeros(1, 200)
    out = Sampler()(lg, [SamplingRow(SamplingParams(top_k=65, top_p=0.25), [1], [],
                                     num_samples=4000)])
    assert len({s.token_id for s in out.samples[0]}) == 17


def test_top_p_of_one_keeps_a_negligible_tail():
    # p_max rounds to 1.0 in float32, so the mass above every other token does too; top_p=1 must
    # not drop them (it once did), only top_k=50 does
    lg = torch.tensor([[30.0] + [0.0] * 99])
    probs = lg.softmax(-1).sort(descending=True).values
    kept, resolved = apply_filters(probs[:, :64], [SamplingParams(top_k=50)], 100)
    assert resolved.item() and kept_prefix(kept[0], probs[0, :64]) == 50
