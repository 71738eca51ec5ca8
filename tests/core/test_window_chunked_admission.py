"""With a sliding window, a table covers only one chunk past `num_computed_tokens`, so a window
group holds its window and a chunk, never a whole long prompt: a prompt whose full length would
not fit in the window groups is still admitted and prefilled chunk by chunk, a request whose peak
footprint exceeds the pool is refused at once, and nothing deadlocks. Every query reads its
window back through a fake KV cache (tests/core/core_fakes.py: FakeKVRunner)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.config import CacheConfig, PreemptionMode, SchedulerConfig
from tessera.core.admission import (
    cache_fit,
    check_cache_holds_max_model_len,
    num_draft_pool_blocks,
)
from tessera.core.block_manager import NULL_BLOCK, AllocStatus, BlockManager, num_peak_blocks
from tessera.core.kv_cache_groups import kv_cache_groups
from tessera.core.scheduler import Scheduler
from tessera.sequence import SequenceStatus
from tessera.utils import cdiv
from tests.core.core_fakes import FakeKVRunner, make_group

BS = 4


def _scheduler(num_gpu_blocks: int, *, sliding_window: int | None = None,
               layer_windows: tuple[int | None, ...] = (), budget: int = 8,
               max_model_len: int = 256, chunked: bool = True, prefix: bool = False,
               mode: PreemptionMode | None = None) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                        max_model_len=max_model_len, enable_chunked_prefill=chunked,
                        preemption_mode=mode),
        CacheConfig(block_size=BS, enable_prefix_caching=prefix, watermark=0.0,
                    sliding_window=sliding_window, layer_windows=layer_windows),
        num_gpu_blocks, num_cpu_blocks=400,
    )


def _check_footprint(scheduler: Scheduler) -> None:
    """Each sequence's live blocks per group stay within `num_peak_blocks`."""
    bm = scheduler.block_manager
    ng = bm.num_groups
    for group in scheduler.running:
        for seq in group.seqs:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            table = bm.get_block_table(seq)
            for g, window in enumerate(bm.group_windows):
                live = sum(b != NULL_BLOCK for b in table[g::ng])
                cap = num_peak_blocks(seq.get_len(), BS, (window,), bm.max_chunk_tokens)
                assert live <= cap, (seq.req_id, g, live, cap)


def test_peak_blocks_bound_every_step_of_a_chunked_prefill():
    """The formula against a walk over every position a chunk can start at: never below the
    blocks held, and at most one above."""
    for window in range(1, 30):
        for chunk in range(1, 30):
            for length in (1, 7, 40, 120):
                held = max(
                    cdiv(min(length, c + chunk), BS) - max(0, c - window + 1) // BS
                    for c in range(length)
                )
                bound = num_peak_blocks(length, BS, (window,), chunk)
                assert held <= bound <= held + 1, (window, chunk, length)
    assert num_peak_blocks(120, BS, (None, 16), 8) == 30 + 7
    assert num_peak_blocks(120, BS, (None, 16), None) == 60  # whole prompts: every block


@pytest.mark.parametrize("windows", [{"sliding_window": 16}, {"layer_windows": (None, 16, 16)}],
                         ids=["mistral", "mixed"])
def test_a_prompt_longer_than_the_window_groups_hold_is_admitted(windows):
    # 100 tokens: 25 blocks a group. Mistral: a pool of 12 blocks (< 25); mixed: one full and
    # two window groups in 25 + 2 x 8 blocks (< 3 x 25 the whole length would take)
    num_gpu_blocks = 12 if "sliding_window" in windows else 41
    scheduler = _scheduler(num_gpu_blocks, **windows)
    bm = scheduler.block_manager
    scheduler.add_seq_group(make_group("long", 100, max_tokens=12))
    scheduler.add_seq_group(make_group("short", 6, max_tokens=4))
    runner = FakeKVRunner(scheduler, bm.group_windows)
    steps = 0
    while scheduler.has_unfinished_seqs():
        out = runner.step()
        assert not out.ignored_request_ids
        bm.check_integrity()
        _check_footprint(scheduler)
        steps += 1
        assert steps < 500
    assert sorted(runner.finished) == ["long", "short"]
    assert bm.gpu.num_free == num_gpu_blocks


def test_without_chunked_prefill_the_whole_prompt_is_allocated():
    scheduler = _scheduler(40, sliding_window=16, budget=256, chunked=False)
    group = make_group("a", 100)
    scheduler.add_seq_group(group)
    scheduler.schedule()
    assert scheduler.block_manager.num_live_blocks(group.seqs[0]) == 25


def test_a_request_that_can_never_fit_is_refused_at_once():
    # the full group alone needs 25 blocks; the pool has 24 in all
    scheduler = _scheduler(24, layer_windows=(None, 16))
    scheduler.add_seq_group(make_group("big", 100))
    scheduler.add_seq_group(make_group("ok", 20, max_tokens=3))
    runner = FakeKVRunner(scheduler, scheduler.block_manager.group_windows)
    out = runner.step()
    assert out.ignored_request_ids == ["big"]
    assert runner.finished == ["big"]  # answered at once, with the reason as its error
    runner.run(max_steps=100)
    assert runner.finished == ["big", "ok"]


def test_start_up_and_n_checks_count_the_window_footprint():
    # Mistral, window 16, chunks of 8: one request of 1024 tokens holds at most 7 blocks
    check_cache_holds_max_model_len(8, BS, 0.0, 1024, group_windows=(16,), max_chunk_tokens=8)
    assert cache_fit(3, 1024, BS, 30, 0.0, group_windows=(16,), max_chunk_tokens=8)[0] == 21
    # mixed: the full group holds the whole length, so 8 blocks are too few, and the message
    # says how long a request does fit
    with pytest.raises(ValueError, match=r"room for 16 tokens\. Raise --kv-cache-space"):
        check_cache_holds_max_model_len(8, BS, 0.0, 1024, group_windows=(None, 16),
                                        max_chunk_tokens=8)
    with pytest.raises(ValueError, match=r"--max-model-len 1024"):
        check_cache_holds_max_model_len(8, BS, 0.0, 1024, group_windows=(16,))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layer_windows=st.sampled_from([(6,), (13,), (None, 6), (None, 9, 9), (5, None, 5, None)]),
    num_gpu_blocks=st.integers(10, 60),
    budget=st.integers(2, 16),
    mode=st.sampled_from([PreemptionMode.SWAP, PreemptionMode.RECOMPUTE]),
    prefix=st.booleans(),
    requests=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 10), st.booleans()),
                      min_size=1, max_size=6),
)
def test_chunked_window_admission_never_deadlocks(layer_windows, num_gpu_blocks, budget, mode,
                                                  prefix, requests):
    """Any mix of long and short prompts: each request finishes or is refused at its first
    admission check (never after running), every window reads back, no block leaks, and a
    window group never holds more than its peak."""
    if len(layer_windows) == 1:
        kw: dict = {"sliding_window": layer_windows[0]}
        num_groups = 1
    else:
        kw = {"layer_windows": layer_windows}
        num_groups = len(kv_cache_groups(layer_windows))
    scheduler = _scheduler(num_gpu_blocks * num_groups, budget=budget, max_model_len=120,
                           prefix=prefix, mode=mode, **kw)
    bm = scheduler.block_manager
    shared = list(range(900, 916))
    for i, (prompt_len, max_tokens, share) in enumerate(requests):
        prompt = (shared if share else []) + [i * 100 + j for j in range(prompt_len)]
        scheduler.add_seq_group(make_group(f"r{i}", 0, prompt=prompt[:100],
                                           max_tokens=max_tokens))
    runner = FakeKVRunner(scheduler, bm.group_windows)
    ignored: list[str] = []
    steps = 0
    while scheduler.has_unfinished_seqs():
        out = runner.step()
        ignored += out.ignored_request_ids
        bm.check_integrity()
        _check_footprint(scheduler)
        steps += 1
        assert steps < 4000, "no progress"
    assert sorted(runner.finished) == sorted(f"r{i}" for i in range(len(requests)))
    for req_id in ignored:  # refused only when its peak (at its longest) exceeds the pool
        prompt_len, max_tokens, share = requests[int(req_id[1:])]
        longest = min(prompt_len + 16 * share, 100) + max_tokens
        need = num_peak_blocks(longest, BS, bm.group_windows, bm.max_chunk_tokens)
        assert need > bm.num_gpu_blocks, (req_id, need)
    assert bm.gpu.num_free == bm.num_gpu_blocks and bm.cpu.num_free == bm.num_cpu_blocks


# the draft model's own group (speculative decoding with a window)

def test_draft_group_takes_its_own_pool_and_never_swaps():
    bm = BlockManager(BS, num_gpu_blocks=20, num_cpu_blocks=20, watermark=0.0,
                      sliding_window=8, num_draft_gpu_blocks=12)
    assert bm.group_windows == (8, None) and bm.draft_group == 1
    group = make_group("a", 30)
    seq = group.seqs[0]
    bm.allocate(group)
    table = bm.get_block_table(seq)
    assert all(b >= 20 for b in table[1::2]) and all(b < 20 for b in table[0::2])
    assert bm.gpu.num_free == 12 and bm.draft_gpu.num_free == 4
    seq.num_computed_tokens = 30
    assert bm.release_out_of_window(seq) == 5  # the target's window group only
    assert NULL_BLOCK not in table[1::2]
    bm.check_integrity()
    seq.status = SequenceStatus.RUNNING
    mapping = bm.swap_out(group)
    assert len(mapping) == 3 and bm.draft_gpu.num_free == 12  # the draft's are dropped
    seq.status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(group)
    bm.swap_in(group)
    table = bm.get_block_table(seq)
    assert all(b >= 20 for b in table[1::2]) and bm.draft_gpu.num_free == 4
    bm.check_integrity()
    bm.free(seq)
    assert bm.gpu.num_free == 20 and bm.draft_gpu.num_free == 12
    # a prompt whose draft table alone exceeds the draft pool can never run
    big = make_group("b", 52)
    assert bm.can_allocate(big) is AllocStatus.NEVER and bm.never_fits(big) == "draft"


def test_draft_pool_sizing():
    # Mistral, window 16, chunks of 8, 1024 tokens: the target holds 7 blocks a request, the
    # draft 256; a target pool of 14 (two requests) gives the draft 512
    assert num_draft_pool_blocks(14, BS, 0.0, 1024, (16,), 8) == 512
    assert num_draft_pool_blocks(14, BS, 0.0, 1024, (None,), 8) == 0  # no window: follows
    # at least one request of 2 blocks past a watermark of half the pool: 3 blocks, not 2
    assert num_draft_pool_blocks(1, BS, 0.5, 8, (4,), 8) == 3


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layer_windows=st.sampled_from([(6,), (None, 6), (5, None, 5, None)]),
    num_gpu_blocks=st.integers(12, 40),
    num_draft_gpu_blocks=st.integers(10, 40),
    chunked=st.booleans(),
    mode=st.sampled_from([PreemptionMode.SWAP, PreemptionMode.RECOMPUTE]),
    prefix=st.booleans(),
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 10), st.integers(1, 2),
                                st.booleans()), min_size=1, max_size=6),
)
def test_draft_group_reads_the_whole_context(layer_windows, num_gpu_blocks,
                                             num_draft_gpu_blocks, chunked, mode, prefix,
                                             requests):
    """Any mix (n > 1 forks, prefix hits, both preemption modes): the draft's entries always
    hold its whole context, the target's windows read back, both pools end empty."""
    kw: dict = ({"sliding_window": layer_windows[0]} if len(layer_windows) == 1
                else {"layer_windows": layer_windows})
    num_groups = 1 if len(layer_windows) == 1 else len(kv_cache_groups(layer_windows))
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8 if chunked else 64, max_num_seqs=6,
                        max_model_len=64, enable_chunked_prefill=chunked, preemption_mode=mode),
        CacheConfig(block_size=BS, enable_prefix_caching=prefix, watermark=0.0, **kw),
        num_gpu_blocks * num_groups, num_cpu_blocks=300,
        num_draft_gpu_blocks=num_draft_gpu_blocks,
    )
    bm = scheduler.block_manager
    shared = list(range(900, 912))
    for i, (prompt_len, max_tokens, n, share) in enumerate(requests):
        prompt = (shared if share else []) + [i * 100 + j for j in range(prompt_len)]
        scheduler.add_seq_group(make_group(f"r{i}", 0, prompt=prompt[:48], n=n,
                                           max_tokens=max_tokens))
    runner = FakeKVRunner(scheduler, bm.group_windows, draft_group=bm.draft_group)
    steps = 0
    while scheduler.has_unfinished_seqs():
        runner.step()
        bm.check_integrity()
        steps += 1
        assert steps < 4000, "no progress"
    assert sorted(runner.finished) == sorted(f"r{i}" for i in range(len(requests)))
    assert bm.gpu.num_free == bm.num_gpu_blocks and bm.cpu.num_free == bm.num_cpu_blocks
    assert bm.draft_gpu is not None and bm.draft_gpu.num_free == num_draft_gpu_blocks
