"""The hermes tool-call parser: whole outputs, and streams split at every possible point give the
same content and calls."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.entrypoints.openai.tool_parsers import HermesToolParser

TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
        '</tool_call>')


def test_extract_calls_and_content():
    content, calls = HermesToolParser.extract(TEXT)
    assert content == "Let me check."
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert calls[0].id != calls[1].id


def test_plain_text_and_malformed_calls_stay_content():
    assert HermesToolParser.extract("no calls here") == ("no calls here", [])
    bad = "<tool_call>{not json}</tool_call>"
    assert HermesToolParser.extract(bad) == (bad, [])


def stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    parser = HermesToolParser()
    bounds = [0, *sorted(set(cuts)), len(text)]
    content, calls = "", []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        delta = parser.feed(text[a:b], finished=i == len(bounds) - 2)
        if delta is None:
            continue
        content += delta.content or ""
        calls += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
    return content, calls


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(TEXT)), max_size=12),
       st.sampled_from([TEXT, "plain answer <tool", "a <tool_call>{\"name\": \"x\"", "x" * 3]))
def test_any_split_streams_what_extract_returns(cuts, text):
    cuts = [c for c in cuts if c <= len(text)]
    content, calls = stream(text, cuts)
    want_content, want_calls = HermesToolParser.extract(text)
    assert content.strip() == (want_content or "").strip()
    assert calls == [(c.function.name, c.function.arguments) for c in want_calls]
