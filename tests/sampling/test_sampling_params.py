"""SamplingParams: vLLM's defaults, normalisation, and errors that name the field."""

import pytest

from tessera.sampling.params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert not p.is_greedy and not p.has_penalties


def test_stop_forms():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=["a", "bcd"]).max_stop_str_len == 3
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.7, seed=3).is_greedy
    # greedy with n > 1 and no seed: allowed (as in vLLM), if pointless
    assert SamplingParams(temperature=0, n=3).n == 3


def test_valid_edges_accepted():
    SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                   repetition_penalty=0.01, max_tokens=None, min_tokens=5, logprobs=0,
                   prompt_logprobs=20)
    SamplingParams(max_tokens=4, min_tokens=4, temperature=0)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": "7"}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": 2**31}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 2**40}, "prompt_logprobs"),
    ({"n": 257}, "n"),
    ({"n": 2**70}, "n"),
    ({"temperature": 1e308}, "temperature"),
    ({"temperature": 2**1100}, "temperature"),
    ({"top_p": float("inf")}, "top_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": 1180591620717411303424}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"presence_penalty": float("-inf")}, "presence_penalty"),
    ({"repetition_penalty": 11}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"stop": ["x" * 1025]}, "stop"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"min_tokens": 2**31, "max_tokens": None}, "min_tokens"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**kwargs)


def test_full_64_bit_seed_range_and_long_values_cut_short():
    for seed in (-(2**63), -1, 0, 2**63, 2**64 - 1):
        assert SamplingParams(seed=seed).seed == seed
    with pytest.raises(ValueError) as e:
        SamplingParams(stop=["x" * 100_000])
    assert len(str(e.value)) < 300  # a client's long value is not echoed back whole


def test_message_shows_value():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)


def test_clone_is_independent():
    p = SamplingParams(stop=["a"])
    q = p.clone()
    q.stop.append("b")
    assert p.stop == ["a"] and q == SamplingParams(stop=["a", "b"])
