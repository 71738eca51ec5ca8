"""The shape of a sequence's block table over KV cache groups, and the pure rules that size it:
one home for them, so admission, growth, swap and the engine's start-up checks count alike.

KV cache groups (`group_windows`, a model mixing local and global layers: core/kv_cache_groups.py):
each sequence has one table per group, all drawing from the one device pool. They are kept
interleaved in ONE list, entry `i * num_groups + g` holding logical block i of group g, so the
tables grow together and every message to the runner (a table, a diff of appended ids, a
swap or copy mapping) keeps its single-table shape; with one group it is exactly the single
table of core/block_manager.py. Each window group releases its own entries; full groups keep
theirs:

    groups (full, window 20), block_size 16, next position 41
    table [ 7, NULL,  3, 9,  12, 4 ]     logical 0: group 0 block 7, group 1 released; ...

Speculative decoding with a draft model and a window: the draft attends to the whole context, so
it cannot read the target's window groups, and its layers differ from the target's. It gets a
KV cache group of its own, the last, full-attention, drawing from its own pool (`draft_gpu`,
`num_draft_gpu_blocks`, ids numbered past the target's so that one table and one copy list name
both); the target's window groups still release. Admission and growth check both pools. The
draft's blocks are never prefix-cached nor swapped: it recomputes a request's KV whenever it
comes back, so they are dropped at swap-out and allocated fresh at swap-in.

    groups (window 20, draft), target blocks 0..99, draft blocks 100..: next position 41
    table [ NULL, 107,  3, 101,  12, 104 ]

Admission, growth, copy-on-write and swap count every group's entries (a logical block costs
`num_groups` pool blocks, each `num_groups` times smaller). Prefix caching keeps one chain of
keys per group (each group's own root, core/prefix_cache.py) and a hit is the leading logical
blocks that EVERY group still has cached (core/prefix_hits.py); a window group's released
blocks stay evictable, so a recent prefix still hits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tessera.sequence import Sequence
from tessera.utils import cdiv

# A released table entry (sliding window): keeps positions aligned, holds no block.
NULL_BLOCK = -1


class AllocStatus(enum.Enum):
    OK = "ok"  # fits now
    LATER = "later"  # fits once other requests release blocks
    NEVER = "never"  # does not fit even in an empty cache


def num_peak_blocks(num_tokens: int, block_size: int, group_windows: tuple[int | None, ...],
                    max_chunk_tokens: int | None) -> int:
    """Device blocks one sequence of `num_tokens` tokens holds at most, all KV cache groups
    together. A full group (window None) holds every token block. A window group whose table
    covers at most `max_chunk_tokens` past `num_computed_tokens` (None: the whole length) holds
    the blocks from the window's first, (c - window + 1) // block_size, to the chunk's last,
    (c + max_chunk_tokens - 1) // block_size: at most (max_chunk_tokens + window - 3) //
    block_size + 2 over every c. The one home of this rule: admission's NEVER check, the
    engine's start-up check and its n > 1 check all ask it."""
    n = cdiv(num_tokens, block_size)
    total = 0
    for window in group_windows:
        if window is None or max_chunk_tokens is None:
            total += n
        else:
            total += min(n, (max_chunk_tokens + window - 3) // block_size + 2)
    return total


def num_watermark_blocks(num_gpu_blocks: int, watermark: float) -> int:
    """Device blocks admissions leave free, so running sequences can keep decoding a while
    (`CacheConfig.watermark`, a fraction of the pool). The one home of this rule."""
    return int(watermark * num_gpu_blocks)


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The table layout of one block manager (validated by it): `group_windows` holds each
    group's window (None: full attention), the draft's group included (last, `draft_group`)."""

    block_size: int
    group_windows: tuple[int | None, ...]
    draft_group: int | None
    # tokens a table covers past num_computed_tokens; None: the whole length (no window)
    max_chunk_tokens: int | None

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def target_windows(self) -> tuple[int | None, ...]:
        """The target model's groups' windows (the draft's group left out)."""
        windows, dg = self.group_windows, self.draft_group
        return windows if dg is None else windows[:dg] + windows[dg + 1 :]

    def num_blocks(self, num_tokens: int) -> int:
        """Table entries for `num_tokens` tokens: a logical block per group."""
        return cdiv(num_tokens, self.block_size) * len(self.group_windows)

    def num_cover_tokens(self, seq: Sequence, num_computed_tokens: int,
                         whole: bool = False) -> int:
        """Tokens the table must cover: the whole length plus draft lookahead, or with a window
        at most one chunk past `num_computed_tokens` (unless `whole`)."""
        n = seq.get_len() + len(seq.spec_token_ids)
        if self.max_chunk_tokens is None or whole:
            return n
        return min(n, num_computed_tokens + self.max_chunk_tokens)
