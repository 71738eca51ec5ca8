"""`mistral`: Mistral's calls after the `[TOOL_CALLS]` token. Content may come before it. Two
spellings, by tokenizer version:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (v3, Nemo)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{...}         (v11+)

Call ids are 9 letters and digits: Mistral's chat templates refuse others when the calls are
sent back. Output after `[TOOL_CALLS]` that does not parse is content, whole.
"""

from __future__ import annotations

import json
import random
import re
import string

from tessera.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    ParseResult,
    ToolParser,
    compact_json,
    json_call_at,
    json_value_end,
    partial_suffix,
    skip_ws,
)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"

    def make_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def parse(self, text: str, final: bool) -> ParseResult:
        bot = text.find(BOT)
        if bot < 0:
            keep = 0 if final else partial_suffix(text, BOT)
            return ParseResult(text[:len(text) - keep])
        result = ParseResult(text[:bot])
        i = skip_ws(text, bot + len(BOT))
        if i >= len(text):
            return ParseResult(text) if final else result
        ok = (self._array(text, i, final, result) if text[i] == "["
              else self._named(text, i, final, result))
        return result if ok else ParseResult(text)

    @staticmethod
    def _array(text: str, i: int, final: bool, result: ParseResult) -> bool:
        """[{call}, {call}]; False if malformed (or cut short at the end)."""
        j = skip_ws(text, i + 1)
        while j < len(text):
            if text[j] == "]":
                return not text[j + 1:].strip()
            if text[j] != "{":
                return False
            call, end = json_call_at(text, j, final)
            if end is None:
                if call is not None:
                    result.calls.append(call)
                return not final
            if call is None:
                return False
            result.calls.append(call)
            j = skip_ws(text, end)
            if j < len(text) and text[j] == ",":
                j = skip_ws(text, j + 1)
        return not final

    @staticmethod
    def _named(text: str, i: int, final: bool, result: ParseResult) -> bool:
        """name[ARGS]{...} segments, each after its own [TOOL_CALLS]."""
        while True:
            m = _NAME.match(text, i)
            if m is None:
                return False
            j = m.end()
            if text.startswith(ARGS, j):
                j += len(ARGS)
            elif not final and ARGS.startswith(text[j:]) and j < len(text):
                return True  # "[ARG" arriving
            j = skip_ws(text, j)
            if j >= len(text):
                return not final
            if text[j] != "{":
                return False
            end = json_value_end(text, j)
            if end is None:
                if final:
                    return False
                result.calls.append(ParsedCall(m.group(), compact_json(text[j:]), done=False))
                return True
            try:
                if not isinstance(json.loads(text[j:end]), dict):
                    return False
            except ValueError:
                return False
            result.calls.append(ParsedCall(m.group(), compact_json(text[j:end]), done=True))
            k = skip_ws(text, end)
            if k >= len(text):
                return True
            if text.startswith(BOT, k):
                i = skip_ws(text, k + len(BOT))
                if i >= len(text):
                    return not final
                continue
            return bool(not final and BOT.startswith(text[k:]))
