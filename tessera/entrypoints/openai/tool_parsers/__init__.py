"""Parsers for a model's own tool-call format, for `tool_choice: "auto"` (the model decides).

Enable with `--enable-auto-tool-choice --tool-call-parser NAME`; the names are vLLM's:

- `hermes` (Hermes 2 Pro / 3, Qwen2.5, Qwen3):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): `<|python_tag|>{"name": ..., "parameters": {...}}; ...`
- `mistral` (Mistral 7B v0.3, Nemo, Small): `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`
- `pythonic` (Llama 3.2 / 4 pythonic templates): `[get_weather(city="Paris"), get_time()]`
- `qwen3_xml` (Qwen3-Coder):
  `<tool_call><function=f><parameter=p>v</parameter></function></tool_call>`

Each parser reads whole outputs (`extract`) and streams (`feed`); see `base.py`. Endpoints (chat,
Responses) get a fresh one per choice from `get_tool_parser`.
"""

from __future__ import annotations

from typing import Any

from tessera.entrypoints.openai.tool_parsers.base import ParsedCall, ParseResult, ToolParser
from tessera.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from tessera.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from tessera.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from tessera.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from tessera.entrypoints.openai.tool_parsers.qwen3_xml import Qwen3XMLToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                              PythonicToolParser, Qwen3XMLToolParser)
}


def get_tool_parser(name: str, tools: list[dict[str, Any]] | None = None,
                    max_calls: int | None = None) -> ToolParser:
    """A fresh parser (one per choice: a streaming parser keeps state). ValueError for an
    unknown name."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, "
                         f"got {name!r}")
    return TOOL_PARSERS[name](tools, max_calls)


__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "ParseResult", "ParsedCall", "PythonicToolParser", "Qwen3XMLToolParser", "ToolParser",
           "get_tool_parser"]
