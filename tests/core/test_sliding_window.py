"""Blocks behind a sliding window are released while a request runs, and nothing that still
matters is lost: every query's window stays in live blocks, in the scheduler's table and in the
runner's copy, through swap, recompute, prefix caching and chunked prefill."""

from __future__ import annotations

import pytest

from tessera.config import PreemptionMode
from tessera.core.block_manager import NULL_BLOCK, BlockManager
from tessera.sequence import SequenceStatus
from tests.core.core_fakes import FakeRunner, make_group, make_scheduler

WINDOW, BS = 16, 4


def test_release_keeps_the_window_and_frees_the_rest():
    bm = BlockManager(BS, num_gpu_blocks=16, num_cpu_blocks=16, watermark=0.0,
                      sliding_window=6)
    group = make_group("a", 20)
    seq = group.seqs[0]
    bm.allocate(group)
    assert bm.gpu.num_free == 11  # 5 blocks for 20 tokens
    seq.num_computed_tokens = 20  # next query at 20 sees keys 15..20: blocks 3 and 4
    assert bm.release_out_of_window(seq) == 3
    assert bm.get_block_table(seq)[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in bm.get_block_table(seq)[3:]
    assert bm.gpu.num_free == 14 and bm.num_live_blocks(seq) == 2
    assert bm.release_out_of_window(seq) == 0  # idempotent
    bm.check_integrity()
    bm.free(seq)
    assert bm.gpu.num_free == 16
    bm.check_integrity()


def test_swap_moves_only_live_blocks():
    bm = BlockManager(BS, num_gpu_blocks=16, num_cpu_blocks=16, watermark=0.0, sliding_window=6)
    group = make_group("a", 20)
    seq = group.seqs[0]
    bm.allocate(group)
    seq.num_computed_tokens = 20
    bm.release_out_of_window(seq)
    seq.status = SequenceStatus.RUNNING
    assert len(bm.swap_out(group)) == 2 and bm.cpu.num_free == 14 and bm.gpu.num_free == 16
    seq.status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(group)
    assert len(bm.swap_in(group)) == 2
    table = bm.get_block_table(seq)
    assert table[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in table[3:]
    bm.check_integrity()


def test_no_window_releases_nothing():
    bm = BlockManager(BS, num_gpu_blocks=16, num_cpu_blocks=16, watermark=0.0)
    group = make_group("a", 20)
    bm.allocate(group)
    group.seqs[0].num_computed_tokens = 20
    assert bm.release_out_of_window(group.seqs[0]) == 0 and bm.gpu.num_free == 11


def _check_window_is_live(scheduler, runner: FakeRunner) -> None:
    bm = scheduler.block_manager
    for group in scheduler.running:
        for seq in group.seqs:
            table = bm.get_block_table(seq)
            first = max(0, seq.num_computed_tokens - WINDOW + 1) // BS
            window = table[first:]
            assert NULL_BLOCK not in window
            held = runner.requests[seq.req_id].block_ids
            assert held[first : len(table)] == window


@pytest.mark.parametrize("setting", [
    {"mode": PreemptionMode.SWAP}, {"mode": PreemptionMode.RECOMPUTE},
    {"prefix": True}, {"chunked": True, "max_num_batched_tokens": 8},
], ids=["swap", "recompute", "prefix", "chunked"])
def test_scheduling_with_a_window(setting):
    scheduler = make_scheduler(block_size=BS, num_gpu_blocks=9, num_cpu_blocks=32,
                               max_model_len=48, sliding_window=WINDOW, **setting)
    shared = list(range(500, 516))  # prefix-cache hits across requests
    for i in range(6):
        scheduler.add_seq_group(make_group(f"r{i}", 0, max_tokens=24,
                                           prompt=shared + [i] * (i + 1)))
    runner = FakeRunner(scheduler)
    steps = 0
    while scheduler.has_unfinished_seqs():
        runner.step()
        scheduler.block_manager.check_integrity()
        _check_window_is_live(scheduler, runner)
        steps += 1
        assert steps < 2000
    assert sorted(runner.finished) == [f"r{i}" for i in range(6)]
    assert scheduler.block_manager.num_released_blocks > 0
    assert scheduler.block_manager.gpu.num_free == 9
    if "mode" in setting:
        assert scheduler.num_preemptions_total > 0
