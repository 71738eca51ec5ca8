"""What the runner tells an attention backend about one scheduled sequence of a step, and the
ordering contract on a step's spans (tessera/attention/backend.py says why decodes come first)."""

from __future__ import annotations

from dataclasses import dataclass


def is_decode(num_new_tokens: int, num_computed_tokens: int) -> bool:
    """A decode: one new token after a cached context. The runner puts these first in the batch."""
    return num_new_tokens == 1 and num_computed_tokens > 0


@dataclass
class SeqSpan:
    """What the runner knows about one scheduled sequence in this step."""

    query_start: int  # first row of this sequence in the flat batch
    num_new_tokens: int  # rows [query_start, query_start + num_new_tokens)
    num_computed_tokens: int  # tokens cached before this step = position of its first new token
    block_table: list[int]  # blocks holding the context and the new tokens

    @property
    def is_decode(self) -> bool:
        return is_decode(self.num_new_tokens, self.num_computed_tokens)

    @property
    def num_tokens(self) -> int:
        """Context length after this step: what its last new token attends to."""
        return self.num_computed_tokens + self.num_new_tokens


def check_spans(spans: list[SeqSpan], num_tokens: int) -> int:
    """Assert the ordering contract (decodes first, contiguous rows covering the batch); returns the
    number of decodes."""
    num_decodes = 0
    while num_decodes < len(spans) and spans[num_decodes].is_decode:
        num_decodes += 1
    row = 0
    for i, span in enumerate(spans):
        assert span.query_start == row, f"span {i} starts at row {span.query_start}, expected {row}"
        assert i < num_decodes or not span.is_decode, f"decode span {i} after a prompt chunk"
        row += span.num_new_tokens
    assert row == num_tokens, f"spans cover {row} rows of {num_tokens}"
    return num_decodes
