"""KV cache groups (a model mixing local and global layers): how layers are grouped, and that the
block manager keeps one table per group in one shared pool without losing or sharing a block
wrongly, through admission, decode, release, fork, swap, recompute, chunked prefill and prefix
caching. A fake KV cache (a dict per block id) is written through each group's table and every
query checks that its visible keys read back its own tokens."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.config import CacheConfig, PreemptionMode, SchedulerConfig
from tessera.core.block_manager import NULL_BLOCK, BlockManager
from tessera.core.kv_cache_groups import KVCacheGroupSpec, kv_cache_groups, layer_slots
from tessera.core.scheduler import Scheduler
from tessera.sequence import SequenceStatus
from tessera.utils import cdiv
from tests.core.core_fakes import FakeKVRunner, make_group

GEMMA3_270M = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))


def test_gemma3_layers_form_six_groups_of_three_full_first():
    groups = kv_cache_groups(GEMMA3_270M)
    assert groups[0] == KVCacheGroupSpec(None, (5, 11, 17))
    assert [g.window for g in groups] == [None] + [512] * 5
    assert {len(g.layers) for g in groups} == {3}
    assert groups[1].layers == (0, 1, 2) and groups[2].layers == (3, 4, 6)
    slots = layer_slots(groups)
    assert slots[5] == (0, 0) and slots[11] == (0, 1) and slots[0] == (1, 0)
    assert sorted(layer for g in groups for layer in g.layers) == list(range(18))


def test_uniform_and_alternating_layers():
    assert kv_cache_groups([None] * 4) == (KVCacheGroupSpec(None, (0, 1, 2, 3)),)
    assert kv_cache_groups([8] * 3) == (KVCacheGroupSpec(8, (0, 1, 2)),)
    gemma2 = kv_cache_groups([4, None] * 3)  # local, global, ...
    assert gemma2 == (KVCacheGroupSpec(None, (1, 3, 5)), KVCacheGroupSpec(4, (0, 2, 4)))
    two_windows = kv_cache_groups([None, 8, 8, 4])  # counts 1, 2, 1: groups of one layer
    assert [g.window for g in two_windows] == [None, 4, 8, 8]


def test_window_groups_release_and_full_groups_keep():
    bs = 4
    bm = BlockManager(bs, num_gpu_blocks=40, num_cpu_blocks=0, watermark=0.0,
                      group_windows=(None, 6, 6))
    group = make_group("a", 20)
    seq = group.seqs[0]
    assert bm.num_required_blocks(group) == 15  # 5 token blocks in each of 3 groups
    bm.allocate(group)
    assert bm.gpu.num_free == 25 and bm.get_num_logical_blocks(seq) == 5
    seq.num_computed_tokens = 20  # next query at 20 sees keys 15..20: logical blocks 3 and 4
    assert bm.release_out_of_window(seq) == 6  # logical 0..2 in each window group
    table = bm.get_block_table(seq)
    assert NULL_BLOCK not in table[0::3]  # the full group keeps everything
    for g in (1, 2):
        assert table[g::3][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in table[g::3][3:]
    assert bm.release_out_of_window(seq) == 0
    bm.check_integrity()
    bm.free(seq)
    assert bm.gpu.num_free == 40
    bm.check_integrity()


def test_hybrid_model_holds_more_long_requests_at_equal_memory():
    """Gemma 3 270M's layout, 2048-token requests decoding: with groups a request keeps its whole
    length in the full group only; without, every layer keeps it."""
    bs, length, layers = 16, 2048, 18
    memory = 2000 * layers  # in blocks of ONE layer
    groups = kv_cache_groups(GEMMA3_270M)
    per_block = len(groups[0].layers)
    num_groups = len(groups)
    grouped = BlockManager(bs, num_gpu_blocks=memory // per_block, num_cpu_blocks=0,
                           watermark=0.0, group_windows=tuple(g.window for g in groups))
    plain = BlockManager(bs, num_gpu_blocks=memory // layers, num_cpu_blocks=0, watermark=0.0)

    def concurrent(bm: BlockManager) -> int:
        count = 0
        while True:
            group = make_group(f"r{count}", length)
            if bm.gpu.num_free < bm.num_required_blocks(group):
                return count
            bm.allocate(group)
            seq = group.seqs[0]
            seq.num_computed_tokens = length  # prefilled: the window groups let go
            bm.release_out_of_window(seq)
            count += 1

    assert grouped.num_gpu_blocks == plain.num_gpu_blocks * num_groups
    without, with_groups = concurrent(plain), concurrent(grouped)
    assert without == 15  # 2000 // 128
    # a prefilled request: 128 full-group blocks + 5 x 32 window-group blocks (keys 1537..2048)
    # = 288, not 6 x 128; the last one admitted needs its whole length (768) in every group
    assert with_groups == (grouped.num_gpu_blocks - 768) // 288 + 1 == 40


def _check_caps(scheduler: Scheduler, windows: tuple[int | None, ...]) -> None:
    bm = scheduler.block_manager
    ng, bs = len(windows), bm.block_size
    for group in scheduler.running:
        for seq in group.seqs:
            if seq.status is not SequenceStatus.RUNNING or seq.get_num_uncomputed_tokens() > 1:
                continue
            table = bm.get_block_table(seq)
            for g, window in enumerate(windows):
                live = sum(b != NULL_BLOCK for b in table[g::ng])
                if window is None:
                    assert live == len(table) // ng
                else:  # vLLM's cap for a sliding-window group
                    assert live <= cdiv(window, bs) + 1, (seq.req_id, g, live)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layer_windows=st.sampled_from([(None, 5, 5), (None, 8), (None, 3, 9, 9), (6, None, 6, None)]),
    num_gpu_blocks=st.integers(30, 70),
    mode=st.sampled_from([PreemptionMode.SWAP, PreemptionMode.RECOMPUTE]),
    prefix=st.booleans(),
    chunked=st.booleans(),
    requests=st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(1, 2), st.booleans()),
        min_size=1, max_size=7,
    ),
)
def test_groups_keep_every_window_readable(layer_windows, num_gpu_blocks, mode, prefix, chunked,
                                           requests):
    bs = 4
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=12 if chunked else 40, max_num_seqs=6,
                        max_model_len=40, enable_chunked_prefill=chunked, preemption_mode=mode),
        CacheConfig(block_size=bs, enable_prefix_caching=prefix, watermark=0.0,
                    layer_windows=layer_windows),
        num_gpu_blocks * len(kv_cache_groups(layer_windows)), num_cpu_blocks=200,
    )
    windows = scheduler.block_manager.group_windows
    assert windows == tuple(g.window for g in kv_cache_groups(layer_windows))
    shared = list(range(900, 912))  # a common prefix of three blocks for prefix-cache hits
    for i, (prompt_len, max_tokens, n, share) in enumerate(requests):
        prompt = (shared if share else []) + [i * 50 + j for j in range(prompt_len)]
        scheduler.add_seq_group(make_group(f"r{i}", 0, prompt=prompt[:28], n=n,
                                           max_tokens=max_tokens))
    runner = FakeKVRunner(scheduler, windows)
    steps = 0
    while scheduler.has_unfinished_seqs():
        runner.step()
        scheduler.block_manager.check_integrity()
        _check_caps(scheduler, windows)
        steps += 1
        assert steps < 3000
    bm = scheduler.block_manager
    assert bm.gpu.num_free == bm.num_gpu_blocks and bm.cpu.num_free == bm.num_cpu_blocks
    assert sorted(runner.finished) == sorted(f"r{i}" for i in range(len(requests)))


def test_prefix_hit_needs_every_group():
    bs = 4
    bm = BlockManager(bs, num_gpu_blocks=60, num_cpu_blocks=0, watermark=0.0,
                      enable_prefix_caching=True, group_windows=(None, 4))
    first = make_group("a", 0, prompt=list(range(17)))
    bm.allocate(first)
    seq = first.seqs[0]
    seq.num_computed_tokens = 17
    bm.cache_computed_blocks(seq)
    bm.release_out_of_window(seq)  # window group: logical 0..2 to the evictable cache
    second = make_group("b", 0, prompt=list(range(17)))
    assert bm.get_num_cached_tokens(second, second.seqs[0]) == 16
    # the window group released logical 2, 1, 0 in that order: logical 2 is the least recently
    # used, so the first eviction takes it, and only logical 0 and 1 still hit in every group
    num_plain_free = bm.gpu.num_free - 3
    for _ in range(num_plain_free + 1):
        bm.gpu.allocate()
    assert bm.get_num_cached_tokens(second, second.seqs[0]) == 8


def test_preemption_under_groups_reads_back_every_window():
    """Tight memory: both preemption modes run, and every window still reads back."""
    windows = (None, 6, 6)
    for mode in (PreemptionMode.SWAP, PreemptionMode.RECOMPUTE):
        scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=48,
                            preemption_mode=mode),
            CacheConfig(block_size=4, watermark=0.0, layer_windows=windows,
                        enable_prefix_caching=False),
            num_gpu_blocks=36, num_cpu_blocks=200,
        )
        for i in range(5):
            scheduler.add_seq_group(make_group(f"r{i}", 10, max_tokens=20))
        runner = FakeKVRunner(scheduler, scheduler.block_manager.group_windows)
        runner.run(max_steps=2000)
        scheduler.block_manager.check_integrity()
        assert scheduler.num_preemptions_total > 0, mode
        assert scheduler.block_manager.num_released_blocks > 0
        assert scheduler.block_manager.gpu.num_free == 36
