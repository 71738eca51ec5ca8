"""The reasoning parsers (vLLM's deepseek_r1 and qwen3) on recorded outputs, whole and streamed
token by token or split anywhere."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser

R1_PROMPT = "<｜User｜>2+2?<｜Assistant｜><think>\n"
QWEN_PROMPT = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN_NO_THINK = QWEN_PROMPT + "<think>\n\n</think>\n\n"
QWEN_THINKING_2507 = QWEN_PROMPT + "<think>\n"
# (parser, prompt tail, output, reasoning_content, content)
CASES = [
    ("deepseek_r1", R1_PROMPT, "Two and two.\n</think>\n\nIt is 4.", "Two and two.\n",
     "\n\nIt is 4."),
    ("deepseek_r1", "", "<think>Two and two.</think>4", "Two and two.", "4"),
    ("deepseek_r1", R1_PROMPT, "cut short while thinking", "cut short while thinking", None),
    ("deepseek_r1", R1_PROMPT, "</think>4", None, "4"),
    ("qwen3", QWEN_PROMPT, "<think>\nTwo and two.\n</think>\n\nIt is 4.", "\nTwo and two.\n",
     "\n\nIt is 4."),
    ("qwen3", QWEN_PROMPT, "It is 4, no <think> needed.", None, "It is 4, no <think> needed."),
    ("qwen3", QWEN_NO_THINK, "It is 4.", None, "It is 4."),
    ("qwen3", QWEN_THINKING_2507, "Two and two.</think>It is 4.", "Two and two.", "It is 4."),
    ("deepseek_r1", QWEN_NO_THINK, "It is 4.", None, "It is 4."),
]


def streamed(name, prompt, pieces):
    parser = get_reasoning_parser(name, prompt)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = parser.feed(piece, finished=i == len(pieces) - 1)
        reasoning += r
        content += c
    return (reasoning or None), (content or None)


def test_names():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="--reasoning-parser"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), CASES)
def test_whole_and_token_by_token(name, prompt, text, reasoning, content, default_tokenizer):
    assert get_reasoning_parser(name, prompt).extract(text) == (reasoning, content)
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    pieces = [default_tokenizer.decode(ids[:k + 1])[len(default_tokenizer.decode(ids[:k])):]
              for k in range(len(ids))]
    assert "".join(pieces) == text
    assert streamed(name, prompt, pieces) == (reasoning, content)


@pytest.mark.parametrize(("name", "prompt", "expects"), [
    ("deepseek_r1", R1_PROMPT, True), ("qwen3", QWEN_PROMPT, True),
    ("qwen3", QWEN_NO_THINK, False), ("deepseek_r1", QWEN_NO_THINK, False)])
def test_whether_a_grammar_waits_for_the_reasoning(name, prompt, expects):
    assert get_reasoning_parser(name, prompt).expects_reasoning() is expects


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(0, 60), max_size=8))
def test_any_split(case, cuts):
    name, prompt, text, reasoning, content = case
    bounds = [0, *sorted({c for c in cuts if c <= len(text)}), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert streamed(name, prompt, pieces) == (reasoning, content)
