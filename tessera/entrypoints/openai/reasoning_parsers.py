"""Reasoning parsers: split a reasoning model's `<think>…</think>` from its answer, as vLLM's
`--reasoning-parser` does, into `reasoning_content` and `content`.

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the output starts in reasoning (the
  template opens `<think>`); everything before `</think>` is reasoning, all of it when
  `</think>` never comes.
- `qwen3` (Qwen3, Qwen3-Thinking): reasoning only when the output opens with `<think>` or the
  prompt ends with it (Qwen3-Thinking templates); otherwise the output is content.

Both treat a prompt that already ends with `</think>` (Qwen3's `chat_template_kwargs:
{"enable_thinking": false}` renders `<think>\\n\\n</think>`) as reasoning done: the output is
content. A leading `<think>` in the output is dropped. Streams give the same split as whole
outputs: text that may be the start of a tag is held back until it is known.

`reasoning_ends_in_prompt` and `expects_reasoning` tell the server whether a grammar (structured
outputs, forced tool calls) must wait for `</think>` (see `StructuredOutputsParams`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tessera.entrypoints.openai.tool_parsers.base import partial_suffix
from tessera.sampling.params import SamplingParams

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    """One instance per choice. `prompt_tail`: the end of the rendered prompt (its last few
    tokens, decoded), which says whether the template opened or closed the reasoning."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = THINK_START
    end: ClassVar[str] = THINK_END

    def __init__(self, prompt_tail: str = "") -> None:
        self.prompt_tail = prompt_tail.rstrip()
        self.text = ""
        self.sent_reasoning = ""
        self.sent_content = ""

    def reasoning_ends_in_prompt(self) -> bool:
        return self.prompt_tail.endswith(self.end)

    def starts_in_reasoning(self) -> bool:
        """Whether the output begins inside the reasoning (before any `<think>` of its own)."""
        raise NotImplementedError

    def expects_reasoning(self) -> bool:
        """Whether the model is expected to reason before answering (a grammar then waits for
        the end of the reasoning)."""
        return not self.reasoning_ends_in_prompt()

    def parse(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning so far, or None when there is none; content so far). Both only grow as
        `text` grows."""
        if self.reasoning_ends_in_prompt():
            return None, text
        in_reasoning = self.starts_in_reasoning()
        body = text.lstrip()
        if body.startswith(self.start):
            text, in_reasoning = body[len(self.start):], True
        elif not final and self.start.startswith(body):
            return ("" if in_reasoning else None), ""  # "<thi" may be arriving
        if not in_reasoning:
            return None, text
        cut = text.find(self.end)
        if cut < 0:
            keep = 0 if final else partial_suffix(text, self.end)
            return text[:len(text) - keep], ""
        return text[:cut], text[cut + len(self.end):]

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output, None for an empty part."""
        reasoning, content = self.parse(text, final=True)
        return (reasoning or None), (content or None)

    def feed(self, new_text: str, finished: bool) -> tuple[str, str]:
        """The (reasoning, content) text to stream after `new_text`; either may be empty."""
        self.text += new_text
        reasoning, content = self.parse(self.text, finished)
        reasoning = reasoning or ""
        reasoning_delta = reasoning[len(self.sent_reasoning):]
        content_delta = content[len(self.sent_content):]
        self.sent_reasoning = max(reasoning, self.sent_reasoning, key=len)
        self.sent_content = max(content, self.sent_content, key=len)
        return reasoning_delta, content_delta


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def starts_in_reasoning(self) -> bool:
        return True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def starts_in_reasoning(self) -> bool:
        return self.prompt_tail.endswith(self.start)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str, prompt_tail: str = "") -> ReasoningParser:
    """A fresh parser (one per choice). ValueError for an unknown name."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {name!r}")
    return REASONING_PARSERS[name](prompt_tail)


def constrain_after_reasoning(params: SamplingParams, reasoning: ReasoningParser | None,
                              tokenizer: Any) -> SamplingParams:
    """`params` whose grammar (if any) starts after the model's `</think>` when it is expected
    to reason first (vLLM's rule under --reasoning-parser); unchanged otherwise."""
    so = params.structured_outputs
    if so is None or reasoning is None or not reasoning.expects_reasoning():
        return params
    end_ids = tuple(tokenizer.encode(reasoning.end, add_special_tokens=False))
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(
        so, reasoning_end_token_ids=end_ids))
