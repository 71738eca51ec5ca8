"""`hermes`: calls as JSON objects inside tags (Hermes 2 Pro / 3, Qwen2.5, Qwen3 instruct models)

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is the message's content. A call whose closing tag never comes (the model
stopped on a stop token) still counts when its JSON is whole.
"""

from __future__ import annotations

from tessera.entrypoints.openai.tool_parsers.base import (
    ParseResult,
    ToolParser,
    json_call_at,
    partial_suffix,
    skip_ws,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParseResult:
        result = ParseResult()
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                keep = 0 if final else partial_suffix(text[pos:], OPEN)
                content.append(text[pos:len(text) - keep])
                break
            content.append(text[pos:start])
            body = skip_ws(text, start + len(OPEN))
            close = text.find(CLOSE, body)
            if close >= 0:
                call, end = json_call_at(text[:close], body, final=True)
                if call is not None and end is not None and not text[end:close].strip():
                    result.calls.append(call)
                else:  # malformed: the model's text, as content
                    content.append(text[start:close + len(CLOSE)])
                pos = close + len(CLOSE)
                continue
            call, end = json_call_at(text, body, final)
            if final:  # unclosed at the end: a call if its JSON is whole
                if call is not None and end is not None and not text[end:].strip():
                    result.calls.append(call)
                else:
                    content.append(text[start:])
            elif call is not None:
                result.calls.append(call)
            break
        result.content = "".join(content)
        return result
