"""`qwen3_xml`: Qwen3-Coder's XML calls. Content may come before them.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value loses one newline on each side and is typed by the tool's parameter schema: strings stay
as written; integer, number and boolean values are converted; object and array values are read as
JSON (or a Python literal); `null` is null; a parameter the schema does not name stays a string.
The arguments JSON grows one parameter at a time as the stream arrives.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from tessera.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    ParseResult,
    ToolParser,
    dumps_arguments,
    partial_suffix,
    skip_ws,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_TAG_NAME = re.compile(r"([^>\n]+)>")


class Qwen3XMLToolParser(ToolParser):
    name = "qwen3_xml"

    def parse(self, text: str, final: bool) -> ParseResult:
        result = ParseResult()
        content: list[str] = []
        pos = 0
        while True:
            start = _first(text, pos, (OPEN, FUNCTION))
            if start < 0:
                keep = 0 if final else max(partial_suffix(text[pos:], OPEN),
                                           partial_suffix(text[pos:], FUNCTION))
                content.append(text[pos:len(text) - keep])
                break
            content.append(text[pos:start])
            end = self._call(text, start, final, result)
            if end is None:  # arriving, or malformed
                if final:
                    content.append(text[start:])
                break
            if end < 0:  # malformed and closed: the model's text, as content
                close = text.find(CLOSE, start)
                pos = len(text) if close < 0 else close + len(CLOSE)
                content.append(text[start:pos])
                continue
            pos = end
        result.content = "".join(content)
        return result

    def _call(self, text: str, start: int, final: bool, result: ParseResult) -> int | None:
        """Read the call at text[start] into `result`: its end when complete, None while it is
        arriving (a partial call may be in `result`), -1 when malformed."""
        j = skip_ws(text, start + len(OPEN)) if text.startswith(OPEN, start) else start
        if j >= len(text) or (not text.startswith(FUNCTION, j)
                              and FUNCTION.startswith(text[j:])):
            return None
        if not text.startswith(FUNCTION, j):
            return -1
        m = _TAG_NAME.match(text, j + len(FUNCTION))
        if m is None:
            return None if "\n" not in text[j:] and not final else -1
        name = m.group(1).strip()
        schema = self.tools.get(name, {}).get("parameters") or {}
        properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
        call = ParsedCall(name, "{", done=False)
        args: dict[str, Any] = {}
        j = m.end()
        while True:
            j = skip_ws(text, j)
            if text.startswith(FUNCTION_END, j):
                call.arguments, call.done = dumps_arguments(args), True
                j = skip_ws(text, j + len(FUNCTION_END))
                if text.startswith(CLOSE, j):
                    j += len(CLOSE)
                elif not final and j < len(text) and CLOSE.startswith(text[j:]):
                    result.calls.append(call)
                    return None
                result.calls.append(call)
                return j
            if not text.startswith(PARAMETER, j):
                if not final and (PARAMETER.startswith(text[j:])
                                  or FUNCTION_END.startswith(text[j:])):
                    result.calls.append(call)
                    return None
                return -1
            p = _TAG_NAME.match(text, j + len(PARAMETER))
            if p is None:
                if final or "\n" in text[j:]:
                    return -1
                result.calls.append(call)
                return None
            value_end = text.find(PARAMETER_END, p.end())
            if value_end < 0:
                if final:
                    return -1
                result.calls.append(call)
                return None
            key = p.group(1).strip()
            args[key] = convert(_strip_newline(text[p.end():value_end]), properties.get(key))
            call.arguments = dumps_arguments(args)[:-1]  # "{...": the closing brace comes last
            j = value_end + len(PARAMETER_END)


def _first(text: str, pos: int, tags: tuple[str, ...]) -> int:
    found = [i for i in (text.find(t, pos) for t in tags) if i >= 0]
    return min(found) if found else -1


def _strip_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the type its schema names (the text itself when it does not fit)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if value.strip().lower() == "null" and kind != "string":
        return None
    if kind is None or kind == "string":
        return value
    text = value.strip()
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            written_as_int = number.is_integer() and not any(c in text for c in ".eE")
            return int(number) if written_as_int else number
        if kind == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            return value
    except ValueError:
        return value
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
