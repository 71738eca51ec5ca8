"""Prefix caching across KV cache groups, for the block manager: which leading blocks a sequence
takes from the cache at admission, and each group's per-sequence bookkeeping (admitted, fork,
forget; the block manager registers computed blocks with each group's cache directly, a hot
path). Each group keeps its own chain of keys (core/prefix_cache.py); a logical block is a hit
only when EVERY group still has it cached, and a window group's entries that the window has
already left come back as `NULL_BLOCK`, never taken."""

from __future__ import annotations

from tessera.core.block_layout import NULL_BLOCK, BlockLayout
from tessera.core.block_pool import BlockPool
from tessera.core.prefix_cache import PrefixCache
from tessera.sequence import Sequence, SequenceGroup


class PrefixHits:
    def __init__(self, pool: BlockPool, layout: BlockLayout, enable: bool) -> None:
        """`pool`: the device pool (the draft's group caches nothing). `enable`: False keeps no
        chains and finds no hits (--no-enable-prefix-caching)."""
        self.layout = layout
        self._any_window = any(w is not None for w in layout.group_windows)
        ng = layout.num_groups
        self.caches: list[PrefixCache] = (
            [PrefixCache(pool, layout.block_size, g, ng)
             for g in range(ng) if g != layout.draft_group]
            if enable else []
        )

    def admission_hits(self, group: SequenceGroup, seq: Sequence) -> list[int]:
        """The prefix hits `seq` starts its table with: a window group's entries that its
        window has already left (the query at the first uncached token cannot see them) are
        `NULL_BLOCK`, never taken."""
        hits = self.cached_blocks(group, seq)
        layout = self.layout
        if not hits or not self._any_window:
            return hits
        ng, bs = layout.num_groups, layout.block_size
        num_hit_tokens = len(hits) // ng * bs
        for g, window in enumerate(layout.group_windows):
            if window is not None:  # the rule of `release_out_of_window` at that position
                first_visible = num_hit_tokens - window + 1
                for i in range(max(first_visible, 0) // bs):
                    hits[i * ng + g] = NULL_BLOCK
        return hits

    def cached_blocks(self, group: SequenceGroup, seq: Sequence) -> list[int]:
        """Cached leading blocks of `seq`; none for a request that wants prompt logprobs, since
        those need the logits of every prompt position, nor for an embedding request that pools
        every position (MEAN) or the first (CLS)."""
        if (
            not self.caches
            or getattr(group.sampling_params, "prompt_logprobs", None) is not None
        ):
            return []
        if group.pooling_params is not None and group.pooling_params.needs_every_position:
            return []
        if self.layout.num_groups == 1:
            return self.caches[0].hit_blocks(seq)
        # a logical block is a hit only when every group has it cached
        per_group = [pc.hit_blocks(seq) for pc in self.caches]
        k = min(len(hits) for hits in per_group)
        if self.layout.draft_group is None:
            return [hits[i] for i in range(k) for hits in per_group]
        # the draft group (last) caches nothing: a placeholder that `allocate` fills fresh
        return [b for i in range(k) for b in (*(hits[i] for hits in per_group), NULL_BLOCK)]

    def admitted(self, seq: Sequence, num_hit_blocks: int) -> None:
        """The sequence got a device table; its first `num_hit_blocks` came from the cache."""
        for pc in self.caches:
            pc.admitted(seq, num_hit_blocks)

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        for pc in self.caches:
            pc.fork(parent_seq, child_seq)

    def forget(self, seq: Sequence) -> None:
        for pc in self.caches:
            pc.forget(seq)
