"""`pythonic`: calls as a Python list of calls with keyword arguments (Llama 3.2 / 4 with their
pythonic templates, and other models prompted so):

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

The whole output is that list (Llama 4 may wrap it in `<|python_start|>...<|python_end|>`), or it
is content. Argument values are Python literals (strings, numbers, True/False/None, lists,
dicts); anything else (a variable, a call) makes the output content. Arguments become a JSON
object, streamed one argument at a time.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from tessera.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    ParseResult,
    ToolParser,
    dumps_arguments,
    skip_ws,
)

START, END = "<|python_start|>", "<|python_end|>"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_KWARG = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*")
_NAME_ARRIVING = re.compile(r"[A-Za-z_]?[A-Za-z0-9_]*\s*")


class _Malformed(Exception):
    pass


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> ParseResult:
        i = skip_ws(text, 0)
        if text.startswith(START, i):
            i = skip_ws(text, i + len(START))
        elif not final and START.startswith(text[i:]):
            return ParseResult()
        if i >= len(text):
            return ParseResult(text if final else "")
        if text[i] != "[":
            return ParseResult(text)
        result = ParseResult()
        try:
            complete = _calls(text, skip_ws(text, i + 1), result)
        except _Malformed:
            return ParseResult(text)
        if final and not complete:
            return ParseResult(text)
        return result


def _calls(text: str, j: int, result: ParseResult) -> bool:
    """Read calls into `result` from text[j]; True once the list is closed (and nothing but an
    optional end tag follows). _Malformed if the text cannot be such a list."""
    while j < len(text):
        if text[j] == "]":
            rest = text[j + 1:].strip()
            if rest and not END.startswith(rest) and rest != END:
                raise _Malformed
            return rest in ("", END)
        m = _IDENT.match(text, j)
        if m is None:
            raise _Malformed
        k = m.end()
        if k >= len(text):
            return False  # the name may go on
        if text[k] != "(":
            raise _Malformed
        call = ParsedCall(m.group(), "{", done=False)
        result.calls.append(call)
        j, args = skip_ws(text, k + 1), {}
        while True:
            if j >= len(text):
                return False
            if text[j] == ")":
                call.arguments, call.done = dumps_arguments(args), True
                j = skip_ws(text, j + 1)
                if j < len(text) and text[j] == ",":
                    j = skip_ws(text, j + 1)
                break
            kw = _KWARG.match(text, j)
            if kw is None:
                if _NAME_ARRIVING.fullmatch(text, j):
                    return False  # a name still arriving
                raise _Malformed
            end = _literal_end(text, kw.end())
            if end is None:
                return False
            try:
                args[kw.group(1)] = ast.literal_eval(text[kw.end():end].strip())
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                raise _Malformed from None
            call.arguments = dumps_arguments(args)[:-1]  # "{...": the closing brace comes last
            j = end + 1 if text[end] == "," else end
            j = skip_ws(text, j)
    return False


def _literal_end(text: str, i: int) -> int | None:
    """Index of the `,` or `)` that ends the Python literal at text[i], or None if the text ends
    first (brackets and quoted strings are matched)."""
    depth = 0
    j = i
    while j < len(text):
        ch = text[j]
        if ch in "\"'":
            j = _py_string_end(text, j)
            if j is None:
                return None
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return j if ch == ")" else _fail()
            depth -= 1
        elif ch == "," and depth == 0:
            return j
        j += 1
    return None


def _py_string_end(text: str, i: int) -> int | None:
    quote = text[i]
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == quote:
            return j + 1
        else:
            j += 1
    return None


def _fail() -> Any:
    raise _Malformed
