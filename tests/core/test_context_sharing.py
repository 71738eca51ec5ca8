"""Shared context tokens: KV blocks several sequences of a step read, counted once, by hand, and
the block tables followed from the scheduler's messages alone."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

from tessera.config import CacheConfig
from tessera.core.block_manager import NULL_BLOCK
from tessera.core.context_sharing import BlockTables, num_shared_context_tokens
from tessera.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tessera.sampling.params import SamplingParams


def test_shared_blocks_are_counted_once():
    # the module docstring's picture: blocks 7, 8, 9 (48 tokens) read by both
    assert num_shared_context_tokens([([7, 8, 9, 21], 60), ([7, 8, 9, 30], 55)], 16) == 48
    # private tables share nothing, however long
    assert num_shared_context_tokens([([1, 2, 3], 40), ([4, 5, 6], 48)], 16) == 0
    # three readers of one prefix block: two re-reads
    assert num_shared_context_tokens([([1, 2], 20), ([1, 3], 17), ([1, 4], 32)], 16) == 32
    # only what a sequence reads counts: the second reads 8 tokens of block 1, which the first
    # reads whole
    assert num_shared_context_tokens([([1, 2], 20), ([1], 8)], 16) == 8


def test_a_shared_last_block_counts_its_longest_read():
    # forked streams before copy-on-write: the partial last block 2 read by both (4 and 3 tokens)
    assert num_shared_context_tokens([([1, 2], 20), ([1, 2], 19)], 16) == 16 + 3
    # a block one sequence reads whole and another in part: the whole read is the distinct one
    assert num_shared_context_tokens([([1, 2, 3], 40), ([1, 2], 20)], 16) == 16 + 4


def test_released_blocks_are_read_by_no_one():
    # out of a sliding window: NULL entries are no shared memory, however many tables hold them
    tables = [([NULL_BLOCK, NULL_BLOCK, 3], 40), ([NULL_BLOCK, NULL_BLOCK, 4], 40)]
    assert num_shared_context_tokens(tables, 16) == 0
    assert num_shared_context_tokens([([NULL_BLOCK, 5, 3], 40), ([NULL_BLOCK, 5, 4], 40)],
                                     16) == 16


def test_kv_cache_groups_average_over_their_entries():
    # two groups, interleaved: logical block 0 is (10, 11), block 1 is (12, 13) / (14, 15); the
    # full group shares block 0, the window group released its entry in the second table
    tables = [([10, 11, 12, 13], 20), ([10, NULL_BLOCK, 14, 15], 20)]
    # group 0 shares 16 tokens, group 1 none: 16 / 2 per group
    assert num_shared_context_tokens(tables, 16, num_groups=2) == 8


def _new(req_id, blocks, computed, num_tokens):
    return NewRequestData(req_id, tuple(range(num_tokens)), (), SamplingParams(), tuple(blocks),
                          computed)


def test_block_tables_follow_new_appended_replaced_and_finished_requests():
    tables = BlockTables(block_size=4)
    # a and b: a prefix hit on blocks 0 and 1 (8 tokens), each with its own third block
    step1 = SchedulerOutput(scheduled_new_reqs=[_new("a", [0, 1, 2], 0, 10),
                                                _new("b", [0, 1, 3], 8, 10)],
                            num_scheduled_tokens={"a": 10, "b": 2})
    tables.update(step1)
    assert tables.num_shared_context_tokens(step1) == 8
    # both decode; a's fourth block arrives as a diff; b's table is replaced (copy-on-write of
    # block 1 into 5): only block 0 stays shared
    step2 = SchedulerOutput(
        scheduled_cached_reqs=[CachedRequestData("a", [1], [4], False, 10),
                               CachedRequestData("b", [1], [0, 5, 3], True, 10)],
        num_scheduled_tokens={"a": 1, "b": 1})
    tables.update(step2)
    assert tables.num_shared_context_tokens(step2) == 4
    # a finishes; c arrives with a's blocks (a prefix hit on all of them) beside b
    step3 = SchedulerOutput(finished_req_ids=["a"],
                            scheduled_new_reqs=[_new("c", [0, 1, 2, 4], 12, 13)],
                            scheduled_cached_reqs=[CachedRequestData("b", [1], [], False, 11)],
                            num_scheduled_tokens={"c": 1, "b": 1})
    tables.update(step3)
    assert tables.num_shared_context_tokens(step3) == 4
    # b and c finish; d and e start on fresh blocks: nothing shared, until e's table is
    # replaced by one that starts with d's first block
    step4 = SchedulerOutput(finished_req_ids=["b", "c"],
                            scheduled_new_reqs=[_new("d", [6, 7], 0, 8), _new("e", [8, 9], 0, 8)],
                            num_scheduled_tokens={"d": 8, "e": 8})
    tables.update(step4)
    assert tables.num_shared_context_tokens(step4) == 0
    step5 = SchedulerOutput(
        scheduled_cached_reqs=[CachedRequestData("d", [1], [], False, 8),
                               CachedRequestData("e", [1], [6, 9], True, 8)],
        num_scheduled_tokens={"d": 1, "e": 1})
    tables.update(step5)
    assert tables.num_shared_context_tokens(step5) == 4
    # a diff for a request whose table was never seen (a log started mid-run) is left out
    step6 = SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("z", [1], [6], False, 3)],
                            num_scheduled_tokens={"z": 1})
    tables.update(step6)
    assert tables.num_shared_context_tokens(step6) == 0


def test_block_tables_take_the_cache_geometry():
    assert BlockTables.for_cache(CacheConfig(block_size=32)).block_size == 32
    gemma = BlockTables.for_cache(CacheConfig(layer_windows=(None, 512, 512, 512)))
    assert gemma.num_groups == 4  # gcd(1, 3) = 1 layer a group: one full, three window
    # a draft model with its own pool adds one full-attention group, last (block_manager.py)
    mistral = CacheConfig(sliding_window=64)
    assert BlockTables.for_cache(mistral).num_groups == 1
    assert BlockTables.for_cache(mistral, num_draft_gpu_blocks=100).num_groups == 2
    assert BlockTables.for_cache(CacheConfig(layer_windows=(None, 512, 512, 512)),
                                 num_draft_gpu_blocks=100).num_groups == 5


def test_looking_only_at_blocks_held_twice_gives_the_full_count():
    """Random tables (distinct blocks each, some released): the count over every block, the
    count over the blocks in two or more tables, and a per-token brute force agree."""
    rng = random.Random(1)
    for _ in range(2000):
        g, bs = rng.choice((1, 2, 3)), rng.choice((1, 4, 16))
        reads = []
        for _ in range(rng.randint(0, 5)):
            n = rng.randint(0, 60)
            table = [b if b % 9 else NULL_BLOCK for b in rng.sample(range(200), -(-n // bs) * g)]
            reads.append((table, n))
        held = Counter(b for table, _ in reads for b in table if b != NULL_BLOCK)
        readers = defaultdict(list)  # block -> tokens each reader reads of it
        for table, n in reads:
            for j, b in enumerate(table):
                if b != NULL_BLOCK:
                    readers[b].append(min(bs, n - j // g * bs))
        brute = sum(sum(r) - max(r) for r in readers.values()) // g
        assert num_shared_context_tokens(reads, bs, g) == brute
        twice = {b for b, k in held.items() if k > 1}
        assert num_shared_context_tokens(reads, bs, g, twice) == brute


def test_followed_tables_count_what_a_pass_over_every_table_counts():
    """Random steps of new, growing, replaced and finished requests over a small pool (so
    blocks are often held by several tables): the followed count equals a pass over all the
    step's tables, every step."""
    rng = random.Random(2)
    bs = 4
    tables = BlockTables(bs)
    truth: dict[str, list[int]] = {}  # req_id -> table, kept by the test itself
    for step in range(600):
        out = SchedulerOutput()
        for req_id in rng.sample(sorted(truth), min(len(truth), rng.randint(0, 2))):
            out.finished_req_ids.append(req_id)
            del truth[req_id]
        for k in range(rng.randint(0, 2)):
            req_id = f"s{step}.{k}"
            truth[req_id] = rng.sample(range(24), rng.randint(1, 6))
            out.scheduled_new_reqs.append(_new(req_id, truth[req_id], 0, 1))
        running = [r for r in truth if r not in {n.req_id for n in out.scheduled_new_reqs}]
        for req_id in running:
            if rng.random() < 0.2:  # copy-on-write: a new table
                truth[req_id] = rng.sample(range(24), rng.randint(1, 6))
                diff = CachedRequestData(req_id, [1], list(truth[req_id]), True, 0)
            else:
                grown = rng.sample([b for b in range(24) if b not in truth[req_id]],
                                   rng.randint(0, 1))
                truth[req_id] += grown
                diff = CachedRequestData(req_id, [1], grown, False, 0)
            out.scheduled_cached_reqs.append(diff)
        for req_id in rng.sample(sorted(truth), rng.randint(0, len(truth))):
            out.num_scheduled_tokens[req_id] = rng.randint(1, len(truth[req_id]) * bs)
        tables.update(out)
        computed = out.num_computed_tokens_by_req()
        expected = num_shared_context_tokens(
            [(truth[r], computed[r] + n) for r, n in out.num_scheduled_tokens.items()], bs)
        assert tables.num_shared_context_tokens(out) == expected
