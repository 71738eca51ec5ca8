"""Parsers for a model's own tool-call format, for `tool_choice: "auto"` (the model decides).

`hermes` reads calls written as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the format of Hermes 2 Pro / Hermes 3, Qwen2.5 and Qwen3 instruct models (whose chat templates
render `tools` and ask for it) and of other templates that follow them. Text outside the tags is
the message's content. Enable with `--enable-auto-tool-choice --tool-call-parser hermes`.
"""

from __future__ import annotations

import json
import re
import uuid

from tessera.entrypoints.openai.protocol import (
    ChatDelta,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(_OPEN) + r"\s*(.*?)\s*" + re.escape(_CLOSE), re.DOTALL)


def _to_call(body: str) -> ToolCallOut | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCallOut(id=f"chatcmpl-tool-{uuid.uuid4().hex}", function=FunctionCallOut(
        name=value["name"],
        arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))


class HermesToolParser:
    """Whole outputs (`extract`) and streams (`feed`, one instance per choice)."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # characters of `text` already handled
        self.num_calls = 0

    @staticmethod
    def extract(text: str) -> tuple[str | None, list[ToolCallOut]]:
        """(content, calls). Malformed call bodies stay in the content, as the model wrote them."""
        calls: list[ToolCallOut] = []
        content_parts: list[str] = []
        pos = 0
        for m in _CALL.finditer(text):
            call = _to_call(m.group(1))
            if call is None:
                continue
            content_parts.append(text[pos:m.start()])
            calls.append(call)
            pos = m.end()
        content_parts.append(text[pos:])
        content = "".join(content_parts).strip() if calls else text
        return (content or None), calls

    def feed(self, new_text: str, finished: bool) -> ChatDelta | None:
        """The delta to stream for `new_text`: content up to a possible `<tool_call>`, and each
        call once its closing tag has arrived (calls are sent whole)."""
        self.text += new_text
        content = ""
        calls: list[DeltaToolCall] = []
        while True:
            rest = self.text[self.sent:]
            start = rest.find(_OPEN)
            if start < 0:
                # hold back a tail that may be the start of "<tool_call>"
                keep = 0 if finished else _partial_suffix(rest, _OPEN)
                content += rest[:len(rest) - keep]
                self.sent += len(rest) - keep
                break
            content += rest[:start]
            end = rest.find(_CLOSE, start)
            if end < 0:
                self.sent += start
                if finished:  # an unclosed call: give the text back as content
                    content += rest[start:]
                    self.sent = len(self.text)
                break
            call = _to_call(rest[start + len(_OPEN):end].strip())
            if call is None:
                content += rest[start:end + len(_CLOSE)]
            else:
                calls.append(DeltaToolCall(index=self.num_calls, id=call.id,
                                           function=call.function))
                self.num_calls += 1
            self.sent += end + len(_CLOSE)
        if not content and not calls:
            return None
        if self.num_calls and not calls:
            content = content.strip()
            if not content:
                return None
        return ChatDelta(content=content or None, tool_calls=calls or None)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


TOOL_PARSERS = {"hermes": HermesToolParser}
