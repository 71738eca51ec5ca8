"""Sampler: greedy, seeds independent of the batch, filters, logprobs (penalties and min_tokens:
test_penalties.py)."""

import pytest
import torch
from sampling_helpers import VOCAB, row, tokens

from tessera.sampling.params import SamplingParams
from tessera.sampling.sampler import Sampler, token_logprobs


def seeded(seed, **kw):
    p = SamplingParams(seed=seed, **kw)
    return row(p, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax(logits):
    rows = [row(SamplingParams(temperature=0)) for _ in range(8)]
    assert tokens(Sampler()(logits, rows)) == [[t] for t in logits.argmax(-1).tolist()]


def test_greedy_step_gives_raw_logprobs_and_looks_up_its_kernel_once(logits, monkeypatch):
    """The common step (greedy, one sample a row): argmax and logprobs of the raw rows; the
    fused kernel is looked up on the first call only."""
    from tessera.sampling import sampler as sampler_module

    lookups = []
    real = sampler_module.fused_ops_for
    monkeypatch.setattr(sampler_module, "fused_ops_for",
                        lambda *a: lookups.append(a) or real(*a))
    sampler = Sampler()
    rows = [row(SamplingParams(temperature=0)) for _ in range(8)]
    ref = logits.log_softmax(-1)
    for _ in range(3):
        out = sampler(logits, rows)
        assert tokens(out) == [[t] for t in logits.argmax(-1).tolist()]
        for i, samples in enumerate(out.samples):
            assert samples[0].logprob == pytest.approx(ref[i].max().item(), abs=1e-5)
    assert len(lookups) == 1


def test_greedy_any_float_dtype(logits):
    rows = [row(SamplingParams(temperature=0)) for _ in range(8)]
    out = Sampler()(logits.bfloat16(), rows)
    assert tokens(out) == [[t] for t in logits.bfloat16().float().argmax(-1).tolist()]


def test_greedy_rows_in_a_mixed_batch(logits):
    rows = [row(SamplingParams(temperature=0 if i % 2 else 1.5)) for i in range(8)]
    got = tokens(Sampler()(logits, rows))
    for i in range(1, 8, 2):
        assert got[i] == [logits[i].argmax().item()]


def test_greedy_num_samples_repeats(logits):
    out = Sampler()(logits[:1], [row(SamplingParams(temperature=0, n=3), num_samples=3)])
    assert tokens(out) == [[logits[0].argmax().item()] * 3]


def test_seeded_row_ignores_the_batch(logits):
    big = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    target = big[5].clone()
    params = dict(temperature=0.9, top_p=0.95, top_k=40)

    alone = []
    gen = torch.Generator().manual_seed(1234)
    for _ in range(5):
        out = Sampler()(target[None], [row(SamplingParams(seed=1234, **params), generator=gen)])
        alone.append(out.samples[0][0].token_id)

    in_batch = []
    gen = torch.Generator().manual_seed(1234)
    for step in range(5):
        rows = []
        for i in range(16):
            if i == 5:
                rows.append(row(SamplingParams(seed=1234, **params), generator=gen))
            elif i % 3 == 0:
                rows.append(seeded(i + step, temperature=1.3))
            elif i % 3 == 1:
                rows.append(row(SamplingParams(temperature=0.5, min_p=0.1), num_samples=2))
            else:
                rows.append(row(SamplingParams(temperature=0)))
        # other rows change every step; the seeded one sees the same logits
        big = torch.randn(16, VOCAB) * 3
        big[5] = target
        in_batch.append(Sampler()(big, rows).samples[5][0].token_id)
    assert alone == in_batch


def test_seed_reproducible_and_varied(logits):
    def draw(seed):
        p = SamplingParams(seed=seed, n=50)
        gen = torch.Generator().manual_seed(seed)
        return tokens(Sampler()(logits[:1], [row(p, num_samples=50, generator=gen)]))[0]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    assert len(set(draw(7))) > 1


def test_seeded_row_without_generator_is_a_bug(logits):
    with pytest.raises(AssertionError, match="generator"):
        Sampler()(logits[:1], [row(SamplingParams(seed=3))])


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0),
                                dict(top_k=1, top_p=0.5)])
def test_filters_that_leave_one_token_are_greedy(logits, kw):
    rows = [row(SamplingParams(temperature=2.0, **kw), num_samples=4) for _ in range(8)]
    assert tokens(Sampler()(logits, rows)) == [[t] * 4 for t in logits.argmax(-1).tolist()]


def _freqs(logits_row, params, n=20000):
    torch.manual_seed(0)
    out = Sampler()(logits_row[None], [row(params, num_samples=n)])
    return torch.bincount(torch.tensor(tokens(out)[0]), minlength=logits_row.numel()).float() / n


def test_samples_follow_the_tempered_distribution():
    lg = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    for t in (0.5, 1.0, 2.0):
        freq = _freqs(lg, SamplingParams(temperature=t))
        assert torch.allclose(freq, (lg / t).softmax(-1), atol=0.015), t


def test_top_k_top_p_min_p_supports():
    lg = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    probs = lg.softmax(-1)
    assert set(_freqs(lg, SamplingParams(top_k=3)).nonzero().flatten().tolist()) == {0, 1, 2}
    # nucleus: smallest prefix whose mass reaches top_p
    p = probs[:2].sum().item() + 0.01
    freq = _freqs(lg, SamplingParams(top_p=p))
    assert set(freq.nonzero().flatten().tolist()) == {0, 1, 2}
    kept = probs[:3] / probs[:3].sum()
    assert torch.allclose(freq[:3], kept, atol=0.015)
    freq = _freqs(lg, SamplingParams(min_p=0.3))  # keeps p >= 0.3 * p_max
    assert set(freq.nonzero().flatten().tolist()) == set((probs >= 0.3 * probs[0]).nonzero()
                                                         .flatten().tolist())
    # top_k off spelled -1 and 0
    for k in (-1, 0):
        assert len(_freqs(lg, SamplingParams(top_k=k, temperature=3.0)).nonzero()) == 6


def test_logprobs_are_raw_log_softmax(logits):
    rows = [
        row(SamplingParams(temperature=0, logprobs=5)),
        row(SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.3, logprobs=2),
            output=[int(logits[1].argmax())]),
        row(SamplingParams(logprobs=0)),
        row(SamplingParams()),  # no logprobs asked: chosen logprob still given
        row(SamplingParams(logprobs=20, temperature=1.2), num_samples=3),
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=0, logprobs=1, min_tokens=3), eos_token_ids=(
            int(logits[6].argmax()),)),
        row(SamplingParams(top_p=0.5, logprobs=3)),
    ]
    ref = logits.log_softmax(-1)
    out = Sampler()(logits, rows)
    for i, (r, samples) in enumerate(zip(rows, out.samples, strict=True)):
        assert len(samples) == r.num_samples
        for s in samples:
            assert s.logprob == pytest.approx(ref[i, s.token_id].item(), abs=1e-5)
            k = r.params.logprobs
            if k is None:
                assert s.top_logprobs is None
                continue
            top = ref[i].topk(k).indices.tolist() if k else []
            assert set(s.top_logprobs) == set(top) | {s.token_id}
            for tok, lp in s.top_logprobs.items():
                assert lp == pytest.approx(ref[i, tok].item(), abs=1e-5)
    # the masked EOS was not chosen, yet logprobs still describe the raw distribution
    assert out.samples[6][0].token_id != logits[6].argmax().item()
    assert len(out.samples[6][0].top_logprobs) == 2


def test_prompt_logprobs():
    lg = torch.randn(4, VOCAB)
    prompt = [5, 9, 1, 30, 2]
    res = token_logprobs(lg, prompt[1:], 3)  # row i predicts prompt token i + 1
    ref = lg.log_softmax(-1)
    assert len(res) == 4
    for i, d in enumerate(res):
        assert set(d) == set(ref[i].topk(3).indices.tolist()) | {prompt[i + 1]}
        for tok, lp in d.items():
            assert lp == pytest.approx(ref[i, tok].item(), abs=1e-5)
    assert token_logprobs(lg[:0], [], 2) == []  # a one-token prompt: nothing to score
    assert list(token_logprobs(lg[:1], [3], 0)[0]) == [3]  # k=0: the actual token only


def test_empty_batch():
    assert Sampler()(torch.empty(0, VOCAB), []).samples == []


def test_filters_widen_past_the_first_candidates():
    # flat over 2000 tokens: top_p=0.9 keeps ~1800, far past the first 64 (and 1024) candidates
    vocab = 2000
    lg = -torch.arange(vocab, dtype=torch.float32)[None] * 1e-4  # no ties: prob order = id order
    lg[0, :10] += 0.5  # a few a little more likely, to check the mass too
    torch.manual_seed(0)
    out = Sampler()(lg, [row(SamplingParams(top_p=0.9), num_samples=20000)])
    freq = torch.bincount(torch.tensor(tokens(out)[0]), minlength=vocab).float() / 20000
    probs = lg[0].softmax(-1)
    n_kept = int(((probs.cumsum(0) - probs) < 0.9).sum())
    assert freq[n_kept:].sum() == 0
    assert freq[:10].sum().item() == pytest.approx((probs[:10].sum() / probs[:n_kept].sum())
                                                   .item(), abs=0.01)
    assert (freq[:n_kept] > 0).sum() > 0.9 * n_kept


def test_seeded_row_with_filters_ignores_the_batch():
    lg = torch.randn(6, 3000, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(top_p=0.97, seed=5), SamplingParams(top_k=2000),
              SamplingParams(min_p=0.5), SamplingParams(top_k=3), SamplingParams(temperature=0),
              SamplingParams(temperature=2.0)]

    def first_row_tokens(batch):
        gen = torch.Generator().manual_seed(5)
        out = []
        for _ in range(4):
            rows = [row(params[0], generator=gen)] + [row(p) for p in params[1:batch]]
            out.append(Sampler()(lg[:batch], rows).samples[0][0].token_id)
        return out

    assert first_row_tokens(1) == first_row_tokens(6)


def test_inverse_cdf_never_picks_a_zero_weight():
    from tessera.sampling.random_draws import inverse_cdf

    w = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]] * 4)
    u = torch.tensor([0.0, 0.3, 0.9999, 1.0 - 2**-24])
    assert inverse_cdf(w, u).tolist() == [1, 3, 3, 3]


def test_greedy_logprobs_on_a_real_vocabulary():
    """The greedy step's token and logprob (the fused argmax + logsumexp kernel on CPU) against
    argmax and log_softmax, with rows that ask for top logprobs beside rows that do not."""
    lg = torch.randn(6, 49152, generator=torch.Generator().manual_seed(3)) * 4
    lg[2, 17] = lg[2, 4000] = lg[2].max() + 2  # a tie
    rows = [row(SamplingParams(temperature=0, logprobs=3 if i % 3 == 0 else None))
            for i in range(6)]
    out = Sampler()(lg, rows)
    ref = lg.double().log_softmax(-1)
    assert tokens(out) == [[t] for t in lg.argmax(-1).tolist()]
    for i, (s,) in enumerate(out.samples):
        # fp32 against float64: a logsumexp of ~20 over 49,152 terms, a few ulps of 2e-6 each
        # (the torch fallback's, on a CPU without the fused kernel, came 1.05e-5 off)
        assert s.logprob == pytest.approx(ref[i, s.token_id].item(), abs=5e-5)
        if i % 3 == 0:
            assert s.top_logprobs[s.token_id] == s.logprob  # one source for both
