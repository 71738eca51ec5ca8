"""Bounded work before admission: text checks, tokenization and chat templating off the event loop.

A request's text is checked before anything costly touches it: a prompt that cannot fit in
`max_model_len` tokens is refused by its length in characters alone (no token is longer than the
vocabulary's longest, so more than `max_model_len` x that many characters can never fit), and a
lone UTF-16 surrogate (valid JSON, invalid Unicode) is refused with a message that names the
field instead of the tokenizer's internal error. What passes is tokenized (or rendered through
the chat template) in one worker thread, so the event loop keeps answering `/health`, `/metrics`
and the other streams meanwhile; one thread, because a fast tokenizer must not be used by two
threads at once (this thread has its own copy), and the length bound keeps each job short.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
from concurrent.futures import ThreadPoolExecutor

from tessera.entrypoints.openai.errors import bad_request
from tessera.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)


def max_token_chars(tokenizer, vocab_size: int) -> int:
    """Characters of the vocabulary's longest token (its surface form: a byte-level token has
    one character per byte, so this also bounds bytes per token)."""
    try:
        pieces = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
        return max(1, max(len(p) for p in pieces if p is not None))
    except Exception:  # an odd tokenizer: a generous, still finite bound
        logger.warning("could not measure the longest token; assuming 128 characters")
        return 128


class Preprocessor:
    """Tokenizes and templates for the server, off the event loop, after the cheap checks."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int) -> None:
        # its own copy: the event loop decodes with the server's while this thread encodes
        self.tokenizer = copy.deepcopy(tokenizer)
        self.max_model_len = max_model_len
        self.max_chars = (max_model_len * max_token_chars(tokenizer, vocab_size)
                          if tokenizer is not None else 0)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-tokenize")

    def check_text(self, text: str, param: str, limit: int | None = None) -> None:
        """Refuse text that can never fit, or is not valid Unicode, before tokenizing it."""
        limit = self.max_chars if limit is None else limit
        if len(text) > limit:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens, and "
                f"{param} has {len(text)} characters, more than fit in it (at most {limit} "
                "here): shorten it", param)
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad_request(
                    f"{param} holds a lone UTF-16 surrogate ({text[e.start]!r} at character "
                    f"{e.start}), which is not valid Unicode text", param) from None

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self.check_text(text, param)
        return await self._run(functools.partial(self.tokenizer.encode,
                                                 add_special_tokens=add_special_tokens), text)

    async def render_chat(self, conversation: list[dict], param: str = "messages",
                          **template_options) -> list[int]:
        """The chat template over the conversation, as token ids; `template_options` go to
        `tessera.tokenizer.apply_chat_template` (tools, chat_template, add_generation_prompt,
        continue_final_message); a template's refusal is a 400 naming `param`."""
        total = 0
        for i, message in enumerate(conversation):
            self.check_text(message["content"], f"messages.{i}.content",
                            max(self.max_chars - total, 0))
            total += len(message["content"])
        try:
            return await self._run(functools.partial(
                apply_chat_template, self.tokenizer, conversation, **template_options))
        except Exception as e:
            raise bad_request(f"could not apply the chat template: {_template_message(e)}",
                              param) from None

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _template_message(e: Exception) -> str:
    """What a client may read of a template failure: the template's own message (a chat template
    raises to say, e.g., that roles must alternate), else only that it failed."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - jinja2 is a dependency
        TemplateError = ()  # type: ignore[assignment]  # noqa: N806
    if isinstance(e, TemplateError) and e.message:
        return e.message[:300]
    if isinstance(e, ValueError) and "chat template" in str(e):
        return str(e)[:300]
    logger.warning("chat template failed: %s: %s", type(e).__name__, e)
    return f"the template raised {type(e).__name__}"
