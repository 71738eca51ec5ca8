"""The CPU side of swapping, for the block manager: the CPU pool, the block tables of swapped
sequences, and the moves of a group's blocks between device and CPU tables (each shared block
once). The block manager owns the device tables and hands them in; it decides when to swap."""

from __future__ import annotations

from tessera.core.block_layout import NULL_BLOCK, BlockLayout
from tessera.core.block_pool import BlockPool
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus
from tessera.utils import cdiv

_RUNNING = SequenceStatus.RUNNING
_SWAPPED = SequenceStatus.SWAPPED


def _distinct(tables: list[list[int]]) -> int:
    return len({b for t in tables for b in t if b != NULL_BLOCK})


class SwapSpace:
    def __init__(self, num_cpu_blocks: int, layout: BlockLayout, gpu: BlockPool,
                 draft_gpu: BlockPool | None) -> None:
        """`gpu`, `draft_gpu`: the device pools blocks move from and to (the draft's blocks are
        dropped at swap-out and allocated fresh at swap-in, never copied)."""
        self.cpu = BlockPool(num_cpu_blocks)
        self.layout = layout
        self.gpu = gpu
        self.draft_gpu = draft_gpu
        self.tables: dict[int, list[int]] = {}  # seq_id -> CPU block table (swapped)

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self.tables

    def free(self, seq: Sequence) -> None:
        """Release the sequence's CPU blocks, if it has any."""
        cpu_table = self.tables.pop(seq.seq_id, None)
        if cpu_table is not None:
            for block in reversed(cpu_table):
                if block != NULL_BLOCK:
                    self.cpu.decref(block)

    def refs(self) -> dict[int, int]:
        """CPU block id -> number of swapped tables holding it (for integrity checks)."""
        cpu_refs: dict[int, int] = {}
        for table in self.tables.values():
            for block in table:
                if block != NULL_BLOCK:
                    cpu_refs[block] = cpu_refs.get(block, 0) + 1
        return cpu_refs

    def can_swap_out(self, group: SequenceGroup, tables: dict[int, list[int]]) -> bool:
        """Room in the CPU pool for the running sequences' device blocks (`tables`)."""
        seq_tables = [tables[s.seq_id] for s in group.seqs if s.status is _RUNNING]
        if self.draft_gpu is not None:  # the draft's blocks are dropped, not swapped
            n = self.gpu.num_blocks
            seq_tables = [[b for b in t if b < n] for t in seq_tables]
        return _distinct(seq_tables) <= self.cpu.num_free

    def swap_out(self, group: SequenceGroup, tables: dict[int, list[int]],
                 mapping: dict[int, int] | None) -> dict[int, int]:
        """Move the running sequences' blocks from `tables` to CPU tables; see
        `BlockManager.swap_out`."""
        return self._move(group, _RUNNING, tables, self.tables, self.gpu, self.cpu, mapping)

    def swap_in_needs(self, group: SequenceGroup) -> tuple[int, int]:
        """Device blocks (target pool, draft pool) that swapping the group in takes: its
        swapped blocks plus, per sequence, one logical block for its next token (or, with a
        window, the blocks of its next chunk if it was prefilling)."""
        seqs = [s for s in group.seqs if s.status is _SWAPPED]
        layout = self.layout
        ng = layout.num_groups
        need = _distinct([self.tables[s.seq_id] for s in seqs])
        need_draft = 0
        for seq in seqs:
            have = len(self.tables[seq.seq_id]) // ng
            grow = max(
                cdiv(layout.num_cover_tokens(seq, seq.num_computed_tokens), layout.block_size)
                - have,
                1)
            if self.draft_gpu is None:
                need += grow * ng
            else:  # the draft's blocks come back fresh, every one
                need += grow * (ng - 1)
                need_draft += have + grow
        return need, need_draft

    def swap_in(self, group: SequenceGroup, tables: dict[int, list[int]],
                mapping: dict[int, int] | None) -> dict[int, int]:
        """Move the swapped sequences' blocks back into device `tables`; see
        `BlockManager.swap_in`."""
        return self._move(group, _SWAPPED, self.tables, tables, self.cpu, self.gpu, mapping)

    def _move(
        self,
        group: SequenceGroup,
        status: SequenceStatus,
        src_tables: dict[int, list[int]],
        dst_tables: dict[int, list[int]],
        src: BlockPool,
        dst: BlockPool,
        mapping: dict[int, int] | None,
    ) -> dict[int, int]:
        # blocks shared between sequences (fork, prefix cache) are copied once and stay shared;
        # they are full or about to be copied-on-write, so sharing the copy is safe. The draft
        # group's blocks are not moved: dropped on the way out (NULL_BLOCK in the CPU table),
        # fresh on the way in; the draft recomputes their KV (worker/spec_decode/draft_model.py)
        mapping = {} if mapping is None else mapping
        draft, dg, ng = self.draft_gpu, self.layout.draft_group, self.layout.num_groups
        # swap in: a fresh draft block per distinct group-0 block of the same logical block, so
        # the draft's entries are shared exactly as the target's (copy-on-write copies all of a
        # logical block's entries together, and the runner's diffs rely on it)
        fresh: dict[int, int] = {}
        for seq in group.seqs:
            if seq.status is not status:
                continue
            table = src_tables.pop(seq.seq_id)
            new_table: list[int] = []
            for i, block in enumerate(table):
                if draft is not None and dg is not None and i % ng == dg:
                    if dst is self.gpu:  # swap in
                        key = new_table[i - dg]
                        if key == NULL_BLOCK:
                            new_table.append(draft.allocate())
                        elif key in fresh:
                            draft.incref(fresh[key])
                            new_table.append(fresh[key])
                        else:
                            fresh[key] = draft.allocate()
                            new_table.append(fresh[key])
                    else:  # swap out
                        draft.decref(block)
                        new_table.append(NULL_BLOCK)
                    continue
                if block == NULL_BLOCK:
                    new_table.append(NULL_BLOCK)
                    continue
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                new_table.append(mapping[block])
            dst_tables[seq.seq_id] = new_table
            for i in range(len(table) - 1, -1, -1):
                block = table[i]
                if block != NULL_BLOCK and (draft is None or i % ng != dg):
                    src.decref(block)
        return mapping
