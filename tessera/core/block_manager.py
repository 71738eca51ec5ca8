"""Block tables: which physical KV blocks hold each sequence's tokens, on the device or in the CPU
swap pool. Emits block-id mappings (swap, copy-on-write) that the cache engine applies; never
touches tensors.

    token positions  0 .. 15 | 16 .. 31 | 32 .. 40      (block_size 16, seq of 41 tokens)
    block table      [   7   ,    3     ,    12    ]    logical block i -> physical block id
                      full,     full,     partial: the next decode writes here

A sequence's blocks are all on the device or all on the CPU. Blocks are shared by ref count between
the sequences of one request after a fork, and, with prefix caching, between requests whose prompts
start with the same full blocks. Invariant: a shared block is never written. Fork shares a partial
block, so `append_slots` copies it first (copy-on-write); prefix caching shares only full, computed
blocks, which lie wholly before every holder's `num_computed_tokens`, where nothing writes.

Without a sliding window, blocks for a sequence's whole current length are allocated at admission
(so chunked prefill never runs out mid-prompt); decoding appends one block at a time. With a
window (and `max_num_batched_tokens` given, as the scheduler does), a table covers only up to
`num_computed_tokens + max_num_batched_tokens` tokens, the most one step can compute: a long
prompt is allocated chunk by chunk, so a window group holds at most about
(window + chunk) / block_size + 2 blocks at any time (`num_peak_blocks`) instead of the whole
prompt's. Admission takes the first chunk's blocks and refuses at once (NEVER) only a request
whose peak footprint exceeds the empty pool; a later chunk that finds the pool full preempts like
a decode does, and a request alone always fits, so nothing deadlocks.

A sequence verifying draft tokens (speculative decoding, `seq.spec_token_ids`) gets lookahead
slots for them too; the slots of rejected drafts stay in its table and are written again by its
next tokens (nothing reads a slot at or past `num_computed_tokens`).

The block manager answers the scheduler and composes parts that each own their state:
  core/block_layout.py   the table's shape over KV cache groups (one table per group, interleaved
                         in one list; the draft model's own group and pool) and the sizing rules;
  core/device_tables.py  the device tables: growth, copy-on-write, fork, free, and the sliding
                         window's release of blocks no query reads again (`NULL_BLOCK` entries);
  core/swap_space.py     the CPU pool and the tables of swapped sequences;
  core/prefix_hits.py    prefix-cache hits across KV cache groups, and their chains.
It keeps the admission accounting (which pool a group's peak footprint fits, the watermark) and
the order of operations across parts (hits are taken before fresh blocks, a swapped-in table is
offered to the prefix cache again).
"""

from __future__ import annotations

from tessera.core.block_layout import (
    NULL_BLOCK,
    AllocStatus,
    BlockLayout,
    num_peak_blocks,
    num_watermark_blocks,
)
from tessera.core.block_pool import BlockPool
from tessera.core.device_tables import DeviceTables
from tessera.core.prefix_cache import PrefixCache
from tessera.core.prefix_hits import PrefixHits
from tessera.core.swap_space import SwapSpace
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus
from tessera.utils import cdiv

# the table layout's names, importable from here as they always were
__all__ = ["NULL_BLOCK", "AllocStatus", "BlockManager", "num_peak_blocks", "num_watermark_blocks"]

_WAITING = SequenceStatus.WAITING
_SWAPPED = SequenceStatus.SWAPPED


class BlockManager:
    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        group_windows: tuple[int | None, ...] = (),
        max_num_batched_tokens: int | None = None,
        num_draft_gpu_blocks: int = 0,
    ) -> None:
        """`sliding_window`: the window of every layer (one group). `group_windows`: with more
        than one KV cache group, each group's window (None: full attention); it replaces
        `sliding_window`. `max_num_batched_tokens`: the most tokens a step computes for one
        sequence; with a window, tables cover only that far past `num_computed_tokens` (None:
        the whole length). `num_draft_gpu_blocks`: the draft model's own pool (speculative
        decoding with a window); it adds a full-attention group, last, that only the draft
        reads; 0: none (the draft, if any, follows the target's table)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if len(group_windows) > 1 and sliding_window is not None:
            raise ValueError("give sliding_window (one group) or group_windows, not both")
        for w in group_windows:
            if w is not None and w < 1:
                raise ValueError(f"group_windows must be >= 1 or None, got {group_windows}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        # per KV cache group, its window (None: full attention); one group unless hybrid
        self.group_windows: tuple[int | None, ...] = (
            group_windows if len(group_windows) > 1 else (sliding_window,)
        )
        self._any_window = any(w is not None for w in self.group_windows)
        if num_draft_gpu_blocks < 0:
            raise ValueError(f"num_draft_gpu_blocks must be >= 0, got {num_draft_gpu_blocks}")
        # the draft model's group (core/block_layout.py), or None
        self.draft_group: int | None = None
        if num_draft_gpu_blocks:
            self.group_windows += (None,)
            self.draft_group = len(self.group_windows) - 1
        self.num_groups = len(self.group_windows)
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        # tokens a table covers past num_computed_tokens; None: the whole length (no window)
        self.max_chunk_tokens = max_num_batched_tokens if self._any_window else None
        self.layout = BlockLayout(block_size, self.group_windows, self.draft_group,
                                  self.max_chunk_tokens)
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        self.watermark_blocks = num_watermark_blocks(num_gpu_blocks, watermark)
        self.gpu = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        # the draft's pool numbers its blocks past the target's, so a table or a copy list
        # names both; never cached (the draft recomputes a request's KV), never swapped
        self.draft_gpu: BlockPool | None = (
            BlockPool(num_draft_gpu_blocks, first_id=num_gpu_blocks)
            if num_draft_gpu_blocks else None
        )
        self.num_draft_gpu_blocks = num_draft_gpu_blocks
        self.draft_watermark_blocks = num_watermark_blocks(num_draft_gpu_blocks, watermark)
        self.device = DeviceTables(self.layout, self.gpu, self.draft_gpu)
        self._tables = self.device.tables  # seq_id -> device block table (read here only)
        self.swap = SwapSpace(num_cpu_blocks, self.layout, self.gpu, self.draft_gpu)
        self.cpu = self.swap.cpu
        self.prefix = PrefixHits(self.gpu, self.layout, enable_prefix_caching)
        self.prefix_caches: list[PrefixCache] = self.prefix.caches
        self.prefix_cache = self.prefix_caches[0] if self.prefix_caches else None
        self.num_prefix_cache_queries = 0  # tokens looked up at admission
        self.num_prefix_cache_hits = 0  # of which found computed in the cache

    # admission

    def num_required_blocks(self, group: SequenceGroup, whole: bool = False) -> int:
        """Blocks the group's waiting sequences hold at most in all (each prefills its own
        tokens; a window group only its window and a chunk, `num_peak_blocks`), the draft
        pool's included. `whole`: allocated for their whole length at once (a prompt whose KV
        a peer sends, core/remote_kv.py)."""
        return sum(self._required(group, whole))

    def _required(self, group: SequenceGroup, whole: bool = False) -> tuple[int, int]:
        """`num_required_blocks` split into (target pool, draft pool)."""
        target = draft = 0
        windows = self.layout.target_windows
        for s in group.seqs:
            if s.status is _WAITING:
                target += num_peak_blocks(s.get_len(), self.block_size, windows,
                                          None if whole else self.max_chunk_tokens)
                if self.draft_gpu is not None:
                    draft += cdiv(s.get_len(), self.block_size)
        return target, draft

    def never_fits(self, group: SequenceGroup, whole: bool = False) -> str | None:
        """Which pool the group's peak footprint exceeds even when empty, or None."""
        target, draft = self._required(group, whole)
        if self.num_gpu_blocks - target < self.watermark_blocks:
            return "device"
        if self.draft_gpu is not None and (
            self.num_draft_gpu_blocks - draft < self.draft_watermark_blocks
        ):
            return "draft"
        return None

    def can_allocate(self, group: SequenceGroup, num_reserved_blocks: int = 0,
                     whole: bool = False) -> AllocStatus:
        """OK if the blocks `allocate` takes for the group's waiting sequences are free now,
        leaving the watermark (and `num_reserved_blocks`, promised elsewhere); NEVER if the
        sequences' peak footprint exceeds even an empty cache. `whole` as for `allocate`."""
        if self.never_fits(group, whole) is not None:
            return AllocStatus.NEVER
        taken = draft_taken = 0
        revived: set[int] = set()
        ng = self.num_groups
        for seq in group.seqs:
            if seq.status is _WAITING:
                hits = self.prefix.admission_hits(group, seq)
                hit_tokens = len(hits) // ng * self.block_size
                n = self.layout.num_blocks(self.layout.num_cover_tokens(seq, hit_tokens, whole))
                if self.draft_gpu is None:
                    taken += n - len(hits)
                else:  # every draft entry is fresh (its hits are placeholders)
                    taken += (n - len(hits)) // ng * (ng - 1)
                    draft_taken += n // ng
                # a hit on an evictable block still takes it off the free count
                revived.update(
                    b for b in hits if b != NULL_BLOCK and self.gpu.ref_counts[b] == 0
                )
        taken += len(revived)
        if self.gpu.num_free - num_reserved_blocks - taken >= self.watermark_blocks and (
            self.draft_gpu is None
            or self.draft_gpu.num_free - draft_taken >= self.draft_watermark_blocks
        ):
            return AllocStatus.OK
        return AllocStatus.LATER

    def get_num_cached_tokens(self, group: SequenceGroup, seq: Sequence) -> int:
        """Leading tokens of `seq` whose KV a prefix-cache hit would supply (no side effects)."""
        return len(self.prefix.cached_blocks(group, seq)) // self.num_groups * self.block_size

    def allocate(self, group: SequenceGroup, whole: bool = False) -> list[int]:
        """Give every waiting sequence of the group blocks for its whole length (with a window:
        up to one chunk past its prefix hits, unless `whole`: a prompt a peer computed lands
        at once). With prefix caching, leading cached blocks are
        shared. Returns, per waiting sequence in group order, the tokens the cache already
        holds: where the scheduler starts its `num_computed_tokens` (core/progress.py)."""
        seqs = [s for s in group.seqs if s.status is _WAITING]
        tables = []
        for seq in seqs:  # take every hit first, so fresh allocations cannot evict them
            assert seq.seq_id not in self._tables and not self.swap.holds(seq)
            hits = self.prefix.admission_hits(group, seq)
            for block in hits:
                if block != NULL_BLOCK:
                    self.gpu.incref(block)
            tables.append(hits)
        if self.draft_gpu is not None and self.draft_group is not None:
            for table in tables:  # the draft's own blocks under the hits
                for i in range(self.draft_group, len(table), self.num_groups):
                    table[i] = self.draft_gpu.allocate()
        num_hit_tokens = []
        for seq, table in zip(seqs, tables, strict=True):
            hit_tokens = len(table) // self.num_groups * self.block_size
            cover = self.layout.num_cover_tokens(seq, hit_tokens, whole)
            self.device.add(seq, table, self.layout.num_blocks(cover))
            if self.prefix_caches:
                self.prefix.admitted(seq, hit_tokens // self.block_size)
                self.num_prefix_cache_queries += seq.get_len()
                self.num_prefix_cache_hits += hit_tokens
            num_hit_tokens.append(hit_tokens)
        return num_hit_tokens

    # decode

    def num_append_blocks(self, group: SequenceGroup) -> int:
        """Blocks `append_slots` will take for the group's running sequences: growth, plus one
        copy per writer of a shared block except that its last holder writes in place (the
        draft pool's included)."""
        return sum(self.device.append_needs(group))

    def can_append_slots(self, group: SequenceGroup) -> bool:
        """Whether every running sequence of the group can get the slots for its new tokens."""
        return self.device.fits(self.device.append_needs(group))

    def try_append_slots(self, group: SequenceGroup) -> list[tuple[int, int]] | None:
        """`can_append_slots` + `append_slots` for every running sequence of the group in one
        pass: the copy-on-write pairs, or None (nothing changed) if the blocks are not there."""
        return self.device.try_append_slots(group)

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Make the table cover `seq.get_len()` tokens (plus its draft tokens' lookahead slots;
        with a window at most one chunk past `num_computed_tokens`) and give the sequence its
        own copy of every shared block it is about to write. Returns the (src, dst) block
        copies to perform."""
        return self.device.append_slots(seq)

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares all of the parent's blocks (ref counts go up)."""
        self.device.fork(parent_seq, child_seq)
        self.prefix.fork(parent_seq, child_seq)

    def free(self, seq: Sequence) -> None:
        """Release whatever the sequence holds (device or CPU). Idempotent."""
        self.device.free(seq)
        self.swap.free(seq)
        self.prefix.forget(seq)

    # swap

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return self.swap.can_swap_out(group, self._tables)

    def swap_out(
        self, group: SequenceGroup, mapping: dict[int, int] | None = None
    ) -> dict[int, int]:
        """Move the running sequences' blocks to the CPU pool. Returns {device_block: cpu_block},
        each shared block once. Pass the step's mapping so far as `mapping` (it is extended in
        place): a block that another group already swapped out this step (a shared prefix-cache
        block) then reuses that CPU copy instead of needing a second entry for the same key."""
        return self.swap.swap_out(group, self._tables, mapping)

    def can_swap_in(self, group: SequenceGroup, use_watermark: bool = True) -> bool:
        """Room for the swapped blocks plus, per sequence, one logical block for its next token
        (or, with a window, the blocks of its next chunk if it was prefilling)."""
        need, need_draft = self.swap.swap_in_needs(group)
        reserve = self.watermark_blocks if use_watermark else 0
        if self.draft_gpu is not None:
            draft_reserve = self.draft_watermark_blocks if use_watermark else 0
            if self.draft_gpu.num_free - need_draft < draft_reserve:
                return False
        return self.gpu.num_free - need >= reserve

    def swap_in(
        self, group: SequenceGroup, mapping: dict[int, int] | None = None
    ) -> dict[int, int]:
        """Move the swapped sequences' blocks back to the device. Returns {cpu_block: device_block};
        `mapping` as for `swap_out`."""
        mapping = self.swap.swap_in(group, self._tables, mapping)
        if self.prefix_caches:  # fresh device blocks: offer their computed KV again
            for seq in group.seqs:
                if seq.status is _SWAPPED:
                    self.prefix.admitted(seq, 0)
                    self.cache_computed_blocks(seq)
        return mapping

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's blocks that are now full and computed to other requests."""
        if self.prefix_caches:
            table = self._tables.get(seq.seq_id)
            if table is not None:  # once per sequence per step: the caches directly
                for pc in self.prefix_caches:
                    pc.register(seq, table)

    def release_out_of_window(self, seq: Sequence, lag: int = 0) -> int:
        """Sliding window: release the sequence's leading blocks, in each window group, that no
        query from its next position on can see; returns how many (core/device_tables.py).
        Offer them to the prefix cache first (`cache_computed_blocks`) to keep them reusable.
        `lag`: keep what the query `lag` positions earlier still sees."""
        if not self._any_window:  # once per sequence per step: no call without a window
            return 0
        return self.device.release_out_of_window(seq, lag)

    @property
    def num_released_blocks(self) -> int:
        """Blocks released by the sliding window, in all."""
        return self.device.num_released_blocks

    def num_live_blocks(self, seq: Sequence) -> int:
        """Device blocks the sequence's table holds (released entries excluded)."""
        return sum(b != NULL_BLOCK for b in self._tables.get(seq.seq_id, ()))

    # queries

    def get_block_table(self, seq: Sequence) -> list[int]:
        """The live device block table (mutated by later `append_slots`; read it this step); with
        several KV cache groups, their tables interleaved (entry i * num_groups + g)."""
        return self._tables[seq.seq_id]

    def get_num_logical_blocks(self, seq: Sequence) -> int:
        """Token blocks the table covers (each is one pool block per KV cache group)."""
        return len(self._tables[seq.seq_id]) // self.num_groups

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tables or self.swap.holds(seq)

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu.num_free

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free

    def gpu_usage(self) -> float:
        return 1.0 - self.gpu.num_free / self.num_gpu_blocks if self.num_gpu_blocks else 0.0

    def cpu_usage(self) -> float:
        return 1.0 - self.cpu.num_free / self.num_cpu_blocks if self.num_cpu_blocks else 0.0

    def check_integrity(self) -> None:
        """In each pool free + used == total, every used block's ref count equals the number of
        tables holding it, and no block is both free and owned; the draft group's entries hold
        the draft pool's blocks and no other entry does. Raises AssertionError."""
        device_refs, draft_refs = self.device.refs()
        self.gpu.check_integrity(device_refs, "device")
        self.cpu.check_integrity(self.swap.refs(), "cpu")
        if self.draft_gpu is not None:
            self.draft_gpu.check_integrity(draft_refs, "draft")
        both = self._tables.keys() & self.swap.tables.keys()
        if both:
            raise AssertionError(f"sequences {sorted(both)} hold blocks on device and CPU at once")
