"""Incremental detokenisation: turn each newly generated token into the text it adds.

Decoding the whole output every step costs O(length) per token, and decoding one token alone is
wrong: a byte-level BPE splits one emoji or CJK character over several tokens, and a
sentencepiece tokenizer drops the leading space of the first token it decodes. So, like vLLM, we
decode a small window of the output ids and keep two offsets into `seq.output_token_ids`:

    ids:   ... | prefix_offset ......... read_offset ............ end |
                 └ already emitted, decoded ┘└ new, not yet emitted ┘
                   again only as context

    new text = decode(ids[prefix:end]) minus decode(ids[prefix:read])

Both decodes start at the same token, so a tokenizer's start-of-text quirks cancel out. While the
window's text ends in U+FFFD (an incomplete UTF-8 character) we emit nothing and wait for the next
token; once it is complete we emit and slide the window (prefix <- read, read <- end). Invariant:
ids[:read] always decodes to whole characters, so a window never starts mid-character.

The concatenation of the pieces equals `tokenizer.decode(output_ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False)`; a tokenizer whose default cleans up spaces (" ." -> ".")
differs from its plain `decode` by that clean-up only.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class DetokState(NamedTuple):
    """Immutable: each update stores a new one."""

    prefix_offset: int = 0
    read_offset: int = 0


class DetokenizedSeq(Protocol):
    """What the detokenizer reads and updates (the output processor's per-sequence state)."""

    output_token_ids: list[int]
    output_text: str
    detok_state: DetokState | None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # a transformers tokenizer (fast or slow)

    def decode_new(self, seq: DetokenizedSeq, skip_special_tokens: bool) -> str:
        """Text added by seq's output tokens not yet detokenised (usually the newest one).

        Appends it to `seq.output_text`, stores the new window in `seq.detok_state`, and returns
        it; "" while the newest tokens end in an incomplete character (or are skipped specials).
        """
        state: DetokState = seq.detok_state or DetokState()
        ids = seq.output_token_ids
        if len(ids) <= state.read_offset:
            return ""
        window = ids[state.prefix_offset :]
        n_prefix = state.read_offset - state.prefix_offset
        prefix_text = self._decode(window[:n_prefix], skip_special_tokens) if n_prefix else ""
        text = self._decode(window, skip_special_tokens)
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""  # nothing visible yet, or a character still being spelled out in bytes
        new_text = text[len(prefix_text) :]
        seq.detok_state = DetokState(state.read_offset, len(ids))
        seq.output_text += new_text
        return new_text

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)
