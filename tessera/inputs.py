"""What a caller hands the engine: the prompt forms it takes and the checks on them, shared by
`LLMEngine` (ValueError) and the OpenAI server (400). Torch-free, so the server and the tests can
import it without the model stack."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class InvalidTokenIdError(ValueError):
    """A prompt entry that is not a token id; `token_id` is the first bad entry, so the server can
    word its own 400."""

    def __init__(self, field_name: str, token_id: object, vocab_size: int) -> None:
        super().__init__(f"{field_name}: {token_id!r} is not a token id in [0, {vocab_size})")
        self.field_name = field_name
        self.token_id = token_id
        self.vocab_size = vocab_size


def check_token_ids(token_ids: Sequence[object], vocab_size: int, field_name: str) -> None:
    """ValueError (InvalidTokenIdError) naming `field_name` unless every entry is a token id: an
    int (not a bool) in [0, vocab_size). An empty list passes; callers word their own empty-prompt
    error."""
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidTokenIdError(field_name, t, vocab_size)


def prompt_token_ids(prompt: str | list[int] | dict, tokenizer: Any,
                     vocab_size: int) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids) for what `LLM.generate` and the engine take: a
    string (encoded with `tokenizer`), token ids, or a dict with `prompt` or `prompt_token_ids`.
    ValueError for an empty prompt, ids outside the vocabulary, or text without a tokenizer."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
        token_ids = tokenizer.encode(prompt)
        text: str | None = prompt
    else:
        token_ids, text = list(prompt), None
        check_token_ids(token_ids, vocab_size, "prompt_token_ids")
    if not token_ids:
        raise ValueError("prompt is empty")
    return text, token_ids
