"""The tool-call parsers (vLLM's formats) on recorded model outputs: whole outputs, the same
outputs streamed token by token (and split anywhere), malformed outputs, several calls, and
`parallel_tool_calls: false`."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from tessera.entrypoints.openai.tool_parsers.base import compact_json

TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
        "temp": {"type": "number"}, "tags": {"type": "array"}}}},
    {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}},
]
WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"zone": "CET"})

# recorded outputs per format: (text, content, calls)
RECORDED = {
    "hermes": [
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
         '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": '
         '"CET"}}\n</tool_call>', "Let me check.", [WEATHER, TIME]),
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', None,
         [TIME]),
        # stopped on a stop token before the closing tag: still a call
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}', None, [TIME]),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
         '{"name": "get_time", "parameters": {"zone": "CET"}}', None, [WEATHER, TIME]),
        ('{"name": "get_time", "arguments": {"zone": "CET"}}', None, [TIME]),
    ],
    "mistral": [
        ('Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
         '{"name": "get_time", "arguments": {"zone": "CET"}}]', "Sure.", [WEATHER, TIME]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time'
         '[ARGS]{"zone": "CET"}', None, [WEATHER, TIME]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3), get_time(zone=\'CET\')]', None, [WEATHER, TIME]),
        ('<|python_start|>[get_time(zone="CET")]<|python_end|>', None, [TIME]),
    ],
    "qwen3_xml": [
        ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
         "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
         "Sure.", [WEATHER, TIME]),
    ],
}
MALFORMED = {
    "hermes": ['<tool_call>{not json}</tool_call>', 'a <tool_call>{"name": "x"',
               '<tool_call>{"arguments": {}}</tool_call>'],
    "llama3_json": ['{"answer": 42}', '{"name": "get_time", "parameters": {"zone": "CET"',
                    'The answer is {"name": 1}'],
    "mistral": ['[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}', "[TOOL_CALLS]",
                "[TOOL_CALLS][not json]"],
    "pythonic": ['[get_time(zone=CET)]', '[get_time("CET")]', "[get_time(zone='CET')",
                 "[1, 2, 3]"],
    "qwen3_xml": ["<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</tool_call>",
                  "<tool_call>\n<oops>\n</tool_call>"],
}
PLAIN = "The weather in Paris is sunny, 21 degrees."
CASES = [(name, *case) for name, cases in RECORDED.items() for case in cases]


def as_pairs(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def stream(name: str, pieces: list[str], **kw) -> tuple[str, list, list]:
    """Feed `pieces`; (content, [(name, arguments)], tool-call deltas in order)."""
    parser = get_tool_parser(name, TOOLS, **kw)
    content, calls, deltas = "", {}, []
    for i, piece in enumerate(pieces):
        for delta in parser.feed(piece, finished=i == len(pieces) - 1):
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                deltas.append(tc)
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], deltas


def test_every_vllm_name_is_registered():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"}
    with pytest.raises(ValueError, match="--tool-call-parser"):
        get_tool_parser("nope")


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_complete_output(name, text, content, calls):
    got_content, got = get_tool_parser(name, TOOLS).extract(text)
    assert got_content == content
    assert as_pairs(got) == calls
    assert len({c.id for c in got}) == len(got)
    assert all(c.type == "function" for c in got)
    # arguments are spaced as json.dumps spaces them
    assert [c.function.arguments for c in got] == [json.dumps(a) for _, a in calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streamed_token_by_token(name, text, content, calls, default_tokenizer):
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    pieces, prev = [], ""
    for k in range(1, len(ids) + 1):  # the detokenizer's deltas: new text per token
        now = default_tokenizer.decode(ids[:k])
        pieces.append(now[len(prev):])
        prev = now
    assert "".join(pieces) == text
    got_content, got_calls, deltas = stream(name, pieces)
    assert (got_content.strip() or None) == content
    whole = get_tool_parser(name, TOOLS).extract(text)[1]
    assert got_calls == [[c.function.name, c.function.arguments] for c in whole]
    # OpenAI's shape: each call opens with index, id, type and name (arguments ""), then only
    # pieces of arguments for that index, more than one for a call with arguments
    for i in range(len(calls)):
        mine = [d for d in deltas if d.index == i]
        assert mine[0].id and mine[0].type == "function" and mine[0].function.name
        assert mine[0].function.arguments == ""
        assert all(d.id is None and d.function.name is None for d in mine[1:])
    if name != "mistral" or "[ARGS]" in text:
        assert len([d for d in deltas if d.index == 0]) > 2  # arguments arrive incrementally


@pytest.mark.parametrize(("name", "text"),
                         [(n, t) for n, texts in MALFORMED.items() for t in texts])
def test_malformed_output_is_content(name, text):
    assert get_tool_parser(name, TOOLS).extract(text) == (text, [])
    content, calls, _ = stream(name, list(text))
    if not calls:
        assert content == text


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_plain_text_is_content(name):
    assert get_tool_parser(name, TOOLS).extract(PLAIN) == (PLAIN, [])
    assert stream(name, list(PLAIN))[:2] == (PLAIN, [])


@pytest.mark.parametrize(("name", "text", "content", "calls"),
                         [c for c in CASES if len(c[3]) > 1])
def test_parallel_tool_calls_false_keeps_the_first(name, text, content, calls):
    got = get_tool_parser(name, TOOLS, max_calls=1).extract(text)[1]
    assert as_pairs(got) == calls[:1]
    _, streamed, _ = stream(name, list(text), max_calls=1)
    assert [(n, json.loads(a)) for n, a in streamed] == calls[:1]


def test_qwen3_xml_types_values_by_the_schema():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n3\n</parameter>\n"
            "<parameter=days>\n4\n</parameter>\n<parameter=hot>\ntrue\n</parameter>\n"
            "<parameter=temp>\n21.5\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
            "<parameter=other>\nnull\n</parameter>\n</function>\n</tool_call>")
    _, calls = get_tool_parser("qwen3_xml", TOOLS).extract(text)
    assert json.loads(calls[0].function.arguments) == {
        "city": "3", "days": 4, "hot": True, "temp": 21.5, "tags": ["a", 1], "other": None}


def test_mistral_ids_are_nine_alphanumerics():
    _, calls = get_tool_parser("mistral", TOOLS).extract(RECORDED["mistral"][0][0])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


def test_compact_json_is_prefix_stable_and_matches_json_dumps():
    raw = '{ "a" :[1 ,2],\n "b": {"c": "x, y: z \\" w"}}'
    assert compact_json(raw) == json.dumps(json.loads(raw))
    assert all(compact_json(raw).startswith(compact_json(raw[:k])) for k in range(len(raw)))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([(n, t) for n, t, _, _ in CASES] + [(n, PLAIN) for n in TOOL_PARSERS]),
       st.lists(st.integers(0, 400), max_size=10))
def test_any_split_streams_what_extract_returns(case, cuts):
    name, text = case
    content, calls, _ = stream(name, split(text, cuts))
    want_content, want_calls = get_tool_parser(name, TOOLS).extract(text)
    assert calls == [[c.function.name, c.function.arguments] for c in want_calls]
    assert (content.strip() or None) == (want_content.strip() if want_content else None)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([(n, t) for n, ts in MALFORMED.items() for t in ts]),
       st.lists(st.integers(0, 400), max_size=10))
def test_malformed_output_streams_as_content_unless_a_call_had_begun(case, cuts):
    """A stream cannot take back a call it has begun (its name complete, its arguments open):
    such a call stays, as vLLM's streams do; otherwise the malformed text is content."""
    name, text = case
    content, calls, _ = stream(name, split(text, cuts))
    if not calls:
        assert content == text


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c for c in cuts if c <= len(text)}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_grammar_allows_one_call_without_parallel_tool_calls(parallel):
    from tessera.entrypoints.openai.protocol import ChatCompletionRequest
    from tessera.entrypoints.openai.structured import tool_constraint

    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
        "parallel_tool_calls": parallel,
        "tools": [{"type": "function", "function": t} for t in TOOLS]})
    schema = tool_constraint(req)["json"]
    assert schema["minItems"] == 1
    assert schema.get("maxItems") == (1 if parallel is False else None)
