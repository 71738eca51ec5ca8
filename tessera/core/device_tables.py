"""The device block tables and their pools: growth as sequences lengthen, copy-on-write of shared
blocks, fork and free, and the sliding window's release of blocks no query will read again. The
block manager (core/block_manager.py) decides admission and swap and calls this part; this part
keeps every device block's ref count equal to the tables that hold it.

Sliding window (`sliding_window` set when every layer of the model attends to a window): a query
at position p reads keys (p - window, p] only, so once a sequence's next position has moved a
whole block past a block's last token, no layer will read that block again. `release_out_of_window`
drops such blocks while the request runs (back to the free list, or, with prefix caching, to the
evictable cached blocks, where other requests can still hit them) and leaves `NULL_BLOCK` in their
table entries, so positions still index the table. Nothing reads a `NULL_BLOCK`: the attention
path of windowed layers gathers only the window's blocks (tessera/attention/windowed.py).

    window 20, block_size 16, next position 41:  keys 22..41 are visible
    block table      [ NULL ,    3     ,    12    ]    block 0 (tokens 0..15) released
"""

from __future__ import annotations

from tessera.core.block_layout import NULL_BLOCK, BlockLayout
from tessera.core.block_pool import BlockPool
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus
from tessera.utils import cdiv

_RUNNING = SequenceStatus.RUNNING


class DeviceTables:
    def __init__(self, layout: BlockLayout, gpu: BlockPool, draft_gpu: BlockPool | None) -> None:
        """`gpu`: the target's pool; `draft_gpu`: the draft model's (its ids follow the
        target's), or None."""
        self.layout = layout
        self.block_size = layout.block_size
        self.group_windows = layout.group_windows
        self.num_groups = layout.num_groups
        self.max_chunk_tokens = layout.max_chunk_tokens
        self._any_window = any(w is not None for w in layout.group_windows)
        self.gpu = gpu
        self.draft_gpu = draft_gpu
        # per group, the pool its blocks come from
        self.pools = [gpu] * self.num_groups
        if draft_gpu is not None and layout.draft_group is not None:
            self.pools[layout.draft_group] = draft_gpu
        self.tables: dict[int, list[int]] = {}  # seq_id -> device block table
        self.num_released_blocks = 0  # released by the sliding window, in all

    def pool_of(self, block: int) -> BlockPool:
        """The pool a device block id belongs to (the draft's ids follow the target's)."""
        if block < self.gpu.num_blocks or self.draft_gpu is None:
            return self.gpu
        return self.draft_gpu

    def add(self, seq: Sequence, table: list[int], num_entries: int) -> None:
        """Give `seq` the table `table` (its prefix hits, already held), grown to `num_entries`
        entries with fresh blocks from each group's pool."""
        pools = self.pools
        ng = self.num_groups
        for i in range(len(table), num_entries):
            table.append(pools[i % ng].allocate())
        self.tables[seq.seq_id] = table

    def append_needs(self, group: SequenceGroup) -> tuple[int, int]:
        """Blocks (target pool, draft pool) `append_slots` will take for the group's running
        sequences: growth, plus one copy per writer of a shared block except that its last
        holder writes in place."""
        bs = self.block_size
        ng = self.num_groups
        tables = self.tables
        pool_of = self.pool_of
        draft = self.draft_gpu
        need = need_draft = 0
        writers: dict[int, int] = {}  # shared block about to be written -> writers in this group
        for seq in group.seqs:
            if seq.status is not _RUNNING:
                continue
            table = tables[seq.seq_id]
            num_tokens = self.layout.num_cover_tokens(seq, seq.num_computed_tokens)
            grow = cdiv(num_tokens, bs) * ng - len(table)
            if grow > 0:
                if draft is None:
                    need += grow
                else:
                    need += grow // ng * (ng - 1)
                    need_draft += grow // ng
            for i in range(
                seq.num_computed_tokens // bs * ng,
                min(len(table), ((num_tokens - 1) // bs + 1) * ng),
            ):
                block = table[i]
                if block != NULL_BLOCK and pool_of(block).ref_counts[block] > 1:
                    writers[block] = writers.get(block, 0) + 1
        for block, w in writers.items():
            pool = pool_of(block)
            if pool is draft:
                need_draft += min(w, pool.ref_counts[block] - 1)
            else:
                need += min(w, pool.ref_counts[block] - 1)
        return need, need_draft

    def fits(self, needs: tuple[int, int]) -> bool:
        return needs[0] <= self.gpu.num_free and (
            self.draft_gpu is None or needs[1] <= self.draft_gpu.num_free)

    def try_append_slots(self, group: SequenceGroup) -> list[tuple[int, int]] | None:
        """`append_slots` for every running sequence of the group, if `append_needs` fits, in
        one pass: the copy-on-write pairs, or None (nothing changed) if the blocks are not there.
        The hot path: a decode that lands in its own partial block costs a few lookups."""
        bs = self.block_size
        tables = self.tables
        ref_counts = self.gpu.ref_counts
        ng = self.num_groups
        chunk = self.max_chunk_tokens
        pool_of = self.pool_of
        for seq in group.seqs:
            if seq.status is not _RUNNING:
                continue
            table = tables[seq.seq_id]
            num_tokens = (
                len(seq.prompt_token_ids) + len(seq.output_token_ids) + len(seq.spec_token_ids)
            )
            if chunk is not None:
                num_tokens = min(num_tokens, seq.num_computed_tokens + chunk)
            last = (num_tokens - 1) // bs
            if ng == 1:
                if not (
                    last < len(table)
                    and seq.num_computed_tokens // bs == last
                    and ref_counts[table[last]] == 1
                ):
                    break  # needs a new block or a copy: take the careful path
            elif not (
                (last + 1) * ng <= len(table)
                and seq.num_computed_tokens // bs == last
                and all(pool_of(b).ref_counts[b] == 1 for b in table[last * ng : (last + 1) * ng])
            ):
                break
        else:
            return []
        if not self.fits(self.append_needs(group)):
            return None
        copies: list[tuple[int, int]] = []
        for seq in group.seqs:
            if seq.status is _RUNNING:
                copies += self.append_slots(seq)
        return copies

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Make the table cover `seq.get_len()` tokens (plus its draft tokens' lookahead slots;
        with a window at most one chunk past `num_computed_tokens`) and
        give the sequence its own copy of every shared block it is about to write. Returns the
        (src, dst) block copies to perform."""
        bs = self.block_size
        ng = self.num_groups
        table = self.tables[seq.seq_id]
        num_tokens = self.layout.num_cover_tokens(seq, seq.num_computed_tokens)
        copies: list[tuple[int, int]] = []
        for i in range(
            seq.num_computed_tokens // bs * ng, min(len(table), ((num_tokens - 1) // bs + 1) * ng)
        ):
            block = table[i]
            if block == NULL_BLOCK:
                continue
            pool = self.pool_of(block)
            if pool.ref_counts[block] > 1:
                assert not pool.is_hashed(block), "a prefix-cached block is about to be written"
                new = pool.allocate()
                pool.decref(block)
                table[i] = new
                copies.append((block, new))
        pools = self.pools
        for i in range(len(table), cdiv(num_tokens, bs) * ng):
            table.append(pools[i % ng].allocate())
        return copies

    def release_out_of_window(self, seq: Sequence, lag: int = 0) -> int:
        """Sliding window: release the sequence's leading blocks, in each window group, that no
        query from its next position on can see (their last token is at or before
        next - window). Returns how many. Offer them to the prefix cache first
        (`BlockManager.cache_computed_blocks`) to keep them reusable. Released entries are
        always a leading run of each group's table, so the scan walks back from the newest
        releasable entry and stops at the first one already released: a step costs what it
        releases. `lag`: keep what the query `lag` positions earlier still sees (a prompt held
        for a peer, whose first query there is the last prompt token, core/kv_connector.py)."""
        if not self._any_window:
            return 0
        table = self.tables.get(seq.seq_id)
        if table is None:
            return 0
        bs = self.block_size
        ng = self.num_groups
        released = 0
        for g, window in enumerate(self.group_windows):
            if window is None:
                continue
            first_visible = seq.num_computed_tokens - lag - window + 1
            for i in range(min(first_visible // bs, len(table) // ng) - 1, -1, -1):
                block = table[i * ng + g]
                if block == NULL_BLOCK:
                    break
                table[i * ng + g] = NULL_BLOCK
                self.gpu.decref(block)
                released += 1
        self.num_released_blocks += released
        return released

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares all of the parent's blocks (ref counts go up)."""
        table = list(self.tables[parent_seq.seq_id])
        for block in table:
            if block != NULL_BLOCK:
                self.pool_of(block).incref(block)
        self.tables[child_seq.seq_id] = table

    def free(self, seq: Sequence) -> None:
        """Release the sequence's device blocks, if it has any."""
        table = self.tables.pop(seq.seq_id, None)
        if table is not None:
            # tail first: with prefix caching the prompt's head becomes the most recently used,
            # so it is evicted last (it is the part other requests are likeliest to share)
            for block in reversed(table):
                if block != NULL_BLOCK:
                    self.pool_of(block).decref(block)

    def refs(self) -> tuple[dict[int, int], dict[int, int]]:
        """(target block id -> tables holding it, the same for the draft pool's blocks), for
        integrity checks. Raises AssertionError if an entry holds a block of the wrong pool:
        the draft group's entries hold the draft pool's blocks and no other entry does."""
        n, dg, ng = self.gpu.num_blocks, self.layout.draft_group, self.num_groups
        draft_refs: dict[int, int] = {}
        device_refs: dict[int, int] = {}
        for sid, table in self.tables.items():
            for i, block in enumerate(table):
                if block == NULL_BLOCK:
                    continue
                is_draft = dg is not None and i % ng == dg
                if is_draft != (block >= n):
                    raise AssertionError(f"sequence {sid}: entry {i} holds block {block} of the "
                                         "wrong pool")
                refs = draft_refs if is_draft else device_refs
                refs[block] = refs.get(block, 0) + 1
        return device_refs, draft_refs
