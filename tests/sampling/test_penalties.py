"""Repetition, frequency and presence penalties and min_tokens (tessera/sampling/penalties.py),
by hand and through the sampler's choice."""

import torch
from sampling_helpers import row, tokens

from tessera.sampling.params import SamplingParams
from tessera.sampling.penalties import penalize
from tessera.sampling.sampler import Sampler


def test_penalties_match_hand_computation():
    lg = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5, 0.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    r = row(p, prompt=[1, 4], output=[2, 2, 0])
    got = penalize(lg.clone(), [r])
    expected = torch.tensor([[
        2.0 / 2 - 0.5 * 1 - 0.25,   # 0: output once, positive -> divided
        -1.0 * 2,                   # 1: prompt only, negative -> multiplied, no freq/presence
        0.5 / 2 - 0.5 * 2 - 0.25,   # 2: output twice
        1.0,                        # 3: unseen
        -0.5 * 2,                   # 4: prompt
        0.0,                        # 5: unseen
    ]])
    torch.testing.assert_close(got, expected)


def test_penalties_change_the_greedy_choice():
    lg = torch.tensor([[2.0, 1.9, 0.0]])
    plain = SamplingParams(temperature=0)
    rep = SamplingParams(temperature=0, repetition_penalty=1.2)
    freq = SamplingParams(temperature=0, frequency_penalty=0.2)
    out = Sampler()(lg.repeat(3, 1), [row(plain, output=[0]), row(rep, prompt=[2], output=[0]),
                                      row(freq, prompt=[0], output=[2])])
    # plain: 0; repetition: 2/1.2 < 1.9 -> 1; frequency over output only (0 is in the prompt) -> 0
    assert tokens(out) == [[0], [1], [0]]


def test_penalties_leave_the_callers_logits_alone(logits):
    before = logits.clone()
    Sampler()(logits, [row(SamplingParams(repetition_penalty=1.5, min_tokens=2),
                           output=[1], eos_token_ids=(2,)) for _ in range(8)])
    assert torch.equal(logits, before)


def test_min_tokens_masks_eos_and_stop_ids():
    lg = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]])  # eos=1 best, then stop id 2, then 3
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    pick = lambda out_len: tokens(Sampler()(lg, [row(p, output=[4] * out_len,  # noqa: E731
                                                     eos_token_ids=(1,))]))[0][0]
    assert pick(0) == 3 and pick(1) == 3
    assert pick(2) == 1
    # ignore_eos does not lift the mask (vLLM's behaviour)
    p = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert tokens(Sampler()(lg, [row(p, eos_token_ids=(1,))]))[0][0] == 2
