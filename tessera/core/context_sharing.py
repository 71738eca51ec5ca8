"""How much of a step's KV context is shared: the tokens attention reads from a block that another
sequence of the same step reads too.

Why a cost model needs it. Prefix caching hands every request that starts with a cached prompt
prefix the same physical blocks, and a forked request's streams share their prompt's blocks. A
step whose sequences share blocks reads less distinct KV than the sum of their contexts:

    block tables (block_size 16)         contexts after the step    read         distinct
    req a  [ 7, 8, 9, 21 ]               60 tokens                   60
    req b  [ 7, 8, 9, 30 ]               55 tokens                   55
                                                                    115 tokens   48 + 12 + 7 = 67
    shared context tokens = 115 - 67 = 48 (blocks 7, 8, 9 counted once)

Blocks 7, 8 and 9 are one set of memory; the second reader finds them in the CPU's cache. On this
machine (the default model, bf16) 8 decodes at 576 tokens over one shared 512-token prefix took
24.9 ms, where 8 at 512 private tokens took 29.0 ms; the calibration grid's fit priced a shared
token's re-read at nothing beyond its attention pairs (docs/simulator.md).

Here, below the engine and the simulator: the step log (tessera/engine/step_log.py) writes the
count of each real step and the simulator's runner (tessera/simulator/batch.py) counts it for
each simulated one, both from the `SchedulerOutput` messages alone, as a runner would see them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from tessera.config import CacheConfig
from tessera.core.block_manager import NULL_BLOCK
from tessera.core.kv_cache_groups import kv_cache_groups
from tessera.core.scheduler_output import SchedulerOutput


def num_shared_context_tokens(reads: Iterable[tuple[Sequence[int], int]], block_size: int,
                              num_groups: int = 1, candidates: set[int] | None = None) -> int:
    """Of the tokens the sequences read, those in blocks another one of them reads too (each
    block counted once, at the most tokens any reader reads of it). `reads`: each sequence's
    device block table and the tokens of its context it reads (its KV length after the step).
    `candidates`, when given, holds every block that can be shared (the others are in one table
    only): only those are looked at. With KV cache groups the table interleaves `num_groups`
    entries per logical block (tessera/core/block_layout.py); the count is then averaged over
    the groups. Released entries (`NULL_BLOCK`, out of a sliding window) are read by no one."""
    bs, g = block_size, num_groups
    full: Counter[int] = Counter()  # block -> readers that read it whole
    partial_read = 0  # tokens read of blocks a sequence reads in part (its last one)
    partial: dict[int, int] = {}  # such a block -> the most tokens one reader reads of it
    for table, num_tokens in reads:
        num_full, rest = divmod(num_tokens, bs)
        entries = table[:num_full * g]
        full.update(entries if candidates is None else candidates.intersection(entries))
        if rest:
            for block in table[num_full * g:(num_full + 1) * g]:
                if block != NULL_BLOCK and (candidates is None or block in candidates):
                    partial_read += rest
                    partial[block] = max(partial.get(block, 0), rest)
    full.pop(NULL_BLOCK, None)
    read = bs * sum(full.values()) + partial_read
    distinct = bs * len(full) + sum(n for b, n in partial.items() if b not in full)
    return (read - distinct) // g


class BlockTables:
    """Each request's device block table, followed from `SchedulerOutput` messages alone, as the
    runner's persistent batch follows them (tessera/worker/input_batch.py): a new request brings
    its whole table, a cached one appends blocks (or replaces its table after copy-on-write), a
    finished one is dropped. `update` must see every step's message, in order, from the first
    step on. A request whose table was never sent (following started mid-run) is left out of
    the count rather than guessed.

    Why it also keeps the tables holding each block: a step can share a block only if two
    followed tables hold it, and most blocks of most workloads are in one table. Keeping them
    costs a few operations per block a request gains, once; a pass over every scheduled table's
    every block, every step, cost 0.7 ms at 256 sequences of 40 blocks here (a third of a
    simulated step). So a step looks only at the requests holding a block another table holds,
    and only at those blocks. Measured on `tessera simulate` (H100 roofline, 3,000 requests at
    rate inf, against the same code without the count): ShareGPT 9.6-10.0 s against 9.2-9.3 s;
    a 512-token shared prefix, every step a pass over ~256 sharing requests, 4.7 s against 3.4.
    A table held past its blocks' release (a preempted request, until it is sent again) can
    make a freed block look held twice: it is then looked at, and the count stays exact. (A
    sliding window's released entries stay in a runner's copy of the table, as the messages
    carry no release: one reused by another sequence of the same step would count as shared,
    here as in the step log.)"""

    def __init__(self, block_size: int, num_groups: int = 1) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size, self.num_groups = block_size, num_groups
        self._tables: dict[str, list[int]] = {}  # req_id -> its device block table
        self._holders: dict[int, set[str]] = {}  # block -> the requests whose table holds it
        self._held_twice: set[int] = set()  # blocks two or more tables hold
        self._num_held_twice: dict[str, int] = {}  # req_id -> its blocks in _held_twice

    @classmethod
    def for_cache(cls, cache: CacheConfig, num_draft_gpu_blocks: int = 0) -> BlockTables:
        """The tables of an engine with `cache`'s block size and KV cache groups, plus the draft
        model's own group when it has a pool of its own (`num_draft_gpu_blocks`, as the block
        manager lays it out: one more entry per logical block)."""
        groups = kv_cache_groups(cache.layer_windows) if cache.layer_windows else ()
        return cls(cache.block_size, max(1, len(groups)) + (1 if num_draft_gpu_blocks else 0))

    def _hold(self, req_id: str, blocks: Iterable[int]) -> None:
        holders, twice, counts = self._holders, self._held_twice, self._num_held_twice
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            held = holders.get(b)
            if held is None:
                holders[b] = {req_id}
                continue
            if len(held) == 1:  # its first holder now shares it
                twice.add(b)
                (first,) = held
                counts[first] += 1
            held.add(req_id)
            counts[req_id] += 1

    def _release(self, req_id: str) -> None:
        holders, twice, counts = self._holders, self._held_twice, self._num_held_twice
        for b in self._tables.pop(req_id, ()):
            if b == NULL_BLOCK:
                continue
            held = holders[b]
            held.discard(req_id)
            if len(held) == 1:  # its last holder no longer shares it
                twice.discard(b)
                (last,) = held
                counts[last] -= 1
            elif not held:
                del holders[b]
        counts.pop(req_id, None)

    def update(self, out: SchedulerOutput) -> None:
        tables = self._tables
        for req_id in out.finished_req_ids:
            self._release(req_id)
        for new in out.scheduled_new_reqs:
            self._set(new.req_id, list(new.block_ids))
        for diff in out.scheduled_cached_reqs:
            if diff.replace_block_ids:
                self._set(diff.req_id, list(diff.new_block_ids))
            elif diff.new_block_ids and diff.req_id in tables:
                tables[diff.req_id].extend(diff.new_block_ids)
                self._hold(diff.req_id, diff.new_block_ids)

    def _set(self, req_id: str, table: list[int]) -> None:
        self._release(req_id)
        self._tables[req_id] = table
        self._num_held_twice[req_id] = 0
        self._hold(req_id, table)

    def num_shared_context_tokens(self, out: SchedulerOutput) -> int:
        """`num_shared_context_tokens` of the step `out` schedules (call `update(out)` first):
        each scheduled request reads its context after the step (computed + scheduled tokens)."""
        if not self._held_twice:
            return 0
        counts = self._num_held_twice
        sharing = [r for r in out.num_scheduled_tokens if counts.get(r)]
        if len(sharing) < 2:
            return 0
        computed = out.num_computed_tokens_by_req()
        tables, scheduled = self._tables, out.num_scheduled_tokens
        return num_shared_context_tokens(
            ((tables[r], computed[r] + scheduled[r]) for r in sharing), self.block_size,
            self.num_groups, self._held_twice)
