"""`llama3_json`: Llama 3.x's JSON calls. The output is calls only when it opens with a JSON
object (after an optional `<|python_tag|>`):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Calls are separated by `;` (or whitespace); `"arguments"` is read like `"parameters"`. An output
that opens with anything else is content; so is one whose first object is not a call. Text after
the last call is content.
"""

from __future__ import annotations

from tessera.entrypoints.openai.tool_parsers.base import (
    ParseResult,
    ToolParser,
    json_call_at,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParseResult:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return ParseResult()  # nothing yet, or the tag arriving
        if i >= len(text):
            return ParseResult("" if not final else text)
        if text[i] != "{":
            return ParseResult(text)
        result = ParseResult()
        while True:
            call, end = json_call_at(text, i, final)
            if end is None:  # still arriving (or cut short at the end)
                if call is not None:
                    result.calls.append(call)
                elif final:
                    return ParseResult(text) if not result.calls else _tail(result, text, i)
                return result
            if call is None:  # a JSON object, but not a call
                return ParseResult(text) if not result.calls else _tail(result, text, i)
            result.calls.append(call)
            j = skip_ws(text, end)
            if j < len(text) and text[j] == ";":
                j = skip_ws(text, j + 1)
            if j >= len(text):
                return result
            if text[j] != "{":
                return _tail(result, text, j)
            i = j


def _tail(result: ParseResult, text: str, i: int) -> ParseResult:
    """Calls so far, and the rest of the text as content."""
    result.content = text[i:]
    return result
