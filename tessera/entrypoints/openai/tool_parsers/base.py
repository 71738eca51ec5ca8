"""What every tool-call parser shares: one `parse(text, final)` per format, and the two ways the
server reads it.

A format's parser only answers "what does this text say so far?": the content so far and the
calls so far, each with its name and its arguments' JSON text so far. It is written so that the
answer only grows as text arrives (content is appended to; a call's arguments text is extended),
which gives both readings from one function:

- `extract(text)`: the whole output at once (a non-streaming response);
- `feed(new_text, finished)`: a stream, one delta per new text; each call is sent first with its
  id, type and name (`arguments: ""`), then as pieces of `arguments`, OpenAI's streaming shape.

Malformed output is content: a call whose text never parses is given back as the model wrote it.
A stream cannot take back what it has sent, so a call is only sent once its name is complete and
its arguments have begun; if the text later turns out broken (or the output is cut short by
max_tokens), the call stays as sent and `finish_reason` tells the client why.

The JSON helpers here read a call object as it streams (`scan_json_call`) and re-space its
arguments the way `json.dumps` does (`compact_json`), character by character, so streamed pieces
always concatenate to the non-streaming `arguments`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tessera.entrypoints.openai.protocol import (
    ChatDelta,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)

_WHITESPACE = " \t\r\n"


@dataclass
class ParsedCall:
    """One call as far as the text goes: `arguments` is JSON text (a prefix of the final text
    while `done` is False)."""

    name: str
    arguments: str
    done: bool


@dataclass
class ParseResult:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    """Base of the model-format parsers. One instance per choice when streaming.

    `tools`: the request's function definitions (`{"name", "parameters", ...}`), for formats whose
    argument values are typed by the schema (qwen3_xml). `max_calls`: 1 under
    `parallel_tool_calls: false` (later calls are dropped), else None."""

    name: ClassVar[str] = ""

    def __init__(self, tools: list[dict[str, Any]] | None = None,
                 max_calls: int | None = None) -> None:
        self.tools = {t["name"]: t for t in tools or []}
        self.max_calls = max_calls
        self.text = ""
        self.sent_content = ""
        self.sent_arguments: list[str] = []
        self.calls: list[ToolCallOut] = []  # what the stream has sent, for finish_reason

    # -- what each format implements ---------------------------------------------------------

    def parse(self, text: str, final: bool) -> ParseResult:
        """Content and calls of `text`; `final`: no more text comes (nothing is held back)."""
        raise NotImplementedError

    def make_call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    # -- the two readings --------------------------------------------------------------------

    def extract(self, text: str) -> tuple[str | None, list[ToolCallOut]]:
        """(content, calls) of a whole output; without calls the content is the text as is."""
        result = self.parse(text, final=True)
        calls = [c for c in result.calls if c.done][:self.max_calls]
        if not calls:
            return (text or None), []
        out = [ToolCallOut(id=self.make_call_id(),
                           function=FunctionCallOut(name=c.name, arguments=c.arguments))
               for c in calls]
        return (result.content.strip() or None), out

    def feed(self, new_text: str, finished: bool) -> list[ChatDelta]:
        """The deltas to stream after `new_text` (in order; often none)."""
        self.text += new_text
        result = self.parse(self.text, finished)
        deltas: list[ChatDelta] = []
        content = result.content
        if len(content) > len(self.sent_content):
            piece = content[len(self.sent_content):]
            self.sent_content = content
            if not (self.calls and piece.isspace()):  # whitespace between calls is not content
                deltas.append(ChatDelta(content=piece))
        for i, call in enumerate(result.calls):
            if self.max_calls is not None and i >= self.max_calls:
                break
            if i == len(self.sent_arguments):  # a new call: id, type and name first
                call_id = self.make_call_id()
                self.calls.append(ToolCallOut(id=call_id, function=FunctionCallOut(
                    name=call.name, arguments="")))
                self.sent_arguments.append("")
                deltas.append(ChatDelta(tool_calls=[DeltaToolCall(
                    index=i, id=call_id, type="function",
                    function=FunctionCallOut(name=call.name, arguments=""))]))
            sent = self.sent_arguments[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                piece = call.arguments[len(sent):]
                self.sent_arguments[i] = call.arguments
                self.calls[i].function.arguments = call.arguments
                deltas.append(ChatDelta(tool_calls=[DeltaToolCall(
                    index=i, id=None, type=None, function=FunctionCallOut(arguments=piece))]))
        return deltas


# -- helpers for formats that hold calls in JSON ------------------------------------------------


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text to hold
    back: the tag may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string opening at text[i], or None if the text ends first."""
    j = i + 1
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
        elif ch == '"':
            return j + 1
        else:
            j += 1
    return None


def json_value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], or None if the text ends first.
    Brackets and strings are matched, nothing is validated (json.loads does that)."""
    ch = text[i]
    if ch == '"':
        return string_end(text, i)
    if ch in "{[":
        depth = 0
        j = i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: ends at a delimiter (more digits may come)
    while j < len(text) and text[j] not in ",}]" + _WHITESPACE:
        j += 1
    return j if j < len(text) else None


def compact_json(raw: str) -> str:
    """JSON text spaced as `json.dumps` spaces it (", " and ": ", no other whitespace), strings
    kept as written. Character by character, so compact_json(prefix) is a prefix of
    compact_json(whole): streamed arguments concatenate to the complete ones."""
    out: list[str] = []
    in_string = escaped = False
    for ch in raw:
        if in_string:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif ch in _WHITESPACE:
            continue
        elif ch == ":":
            out.append(": ")
        elif ch == ",":
            out.append(", ")
        else:
            out.append(ch)
    return "".join(out)


def dumps_arguments(arguments: dict[str, Any]) -> str:
    """Arguments built from parsed values (not JSON text): `json.dumps`, non-ASCII kept."""
    return json.dumps(arguments, ensure_ascii=False)


_ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3.1 writes "parameters"


@dataclass
class _CallScan:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    invalid: bool = False


def _scan_call_keys(text: str, start: int) -> _CallScan:
    """Walk the keys of the call object opening at text[start] as far as the text goes."""
    scan = _CallScan()
    j = skip_ws(text, start + 1)
    while j < len(text):
        ch = text[j]
        if ch in ",}":
            j = skip_ws(text, j + 1)
            continue
        if ch != '"':
            scan.invalid = True
            return scan
        key_end = string_end(text, j)
        if key_end is None:
            return scan
        key = text[j + 1:key_end - 1]
        j = skip_ws(text, key_end)
        if j >= len(text):
            return scan
        if text[j] != ":":
            scan.invalid = True
            return scan
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return scan
        value_end = json_value_end(text, j)
        if key in _ARGUMENT_KEYS and scan.args_start is None:
            scan.args_start, scan.args_end = j, value_end
        elif key == "name" and value_end is not None:
            try:
                name = json.loads(text[j:value_end])
            except ValueError:
                scan.invalid = True
                return scan
            scan.name = name if isinstance(name, str) else None
        if value_end is None:
            return scan
        j = skip_ws(text, value_end)
    return scan


def complete_json_call(text: str, start: int, end: int) -> ParsedCall | None:
    """The call the JSON object text[start:end] stands for: {"name": str, "arguments" or
    "parameters": object (or its JSON text)}; None if it is anything else."""
    try:
        value = json.loads(text[start:end])
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in _ARGUMENT_KEYS if k in value), None)
    arguments = value.get(key, {}) if key else {}
    if isinstance(arguments, str):  # arguments given as JSON text already
        return ParsedCall(value["name"], arguments, done=True)
    if not isinstance(arguments, dict):
        return None
    if key is None:
        return ParsedCall(value["name"], "{}", done=True)
    scan = _scan_call_keys(text, start)
    assert scan.args_start is not None and scan.args_end is not None
    return ParsedCall(value["name"], compact_json(text[scan.args_start:scan.args_end]),
                      done=True)


def partial_json_call(text: str, start: int) -> ParsedCall | None:
    """A call object still arriving at text[start:]: its name and arguments so far, once the
    name is complete and an arguments object has begun (None before that, or if it cannot be
    a call)."""
    if start >= len(text) or text[start] != "{":
        return None
    scan = _scan_call_keys(text, start)
    if scan.invalid or scan.name is None or scan.args_start is None:
        return None
    if text[scan.args_start] != "{":  # arguments as a JSON string: sent once complete
        return None
    end = scan.args_end if scan.args_end is not None else len(text)
    return ParsedCall(scan.name, compact_json(text[scan.args_start:end]), done=False)


def json_call_at(text: str, start: int, final: bool) -> tuple[ParsedCall | None, int | None]:
    """(call, end) for a JSON call object at text[start] (`start` past any whitespace): a complete
    call and where it ends; a partial call (or None) and None while it is still arriving; (None,
    end) for a complete object that is not a call, or (None, None) for text ended at `final`."""
    end = json_value_end(text, start) if start < len(text) else None
    if end is None:
        return (None, None) if final else (partial_json_call(text, start), None)
    return complete_json_call(text, start, end), end
