from core_fakes import make_group

from tessera.core.block_manager import AllocStatus, BlockManager
from tessera.core.block_pool import BlockPool
from tessera.sequence import SequenceStatus, new_seq_id

RUNNING = SequenceStatus.RUNNING
SWAPPED = SequenceStatus.SWAPPED


def admit(bm, group):
    for s, hit_tokens in zip(group.seqs, bm.allocate(group), strict=True):
        s.num_computed_tokens = hit_tokens  # as the scheduler's set_progress does
        s.status = RUNNING
    return group.seqs[0]


def compute(bm, seq):
    """Pretend the forward pass computed everything the sequence has."""
    seq.num_computed_tokens = seq.get_len()
    bm.cache_computed_blocks(seq)


def test_allocate_free_counts_and_integrity():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    seq = admit(bm, make_group("a", 10))
    assert bm.get_block_table(seq) == [0, 1, 2]
    assert bm.get_num_free_gpu_blocks() == 5
    assert abs(bm.gpu_usage() - 3 / 8) < 1e-9
    bm.check_integrity()
    bm.free(seq)
    bm.free(seq)  # idempotent
    assert bm.get_num_free_gpu_blocks() == 8 and bm.gpu_usage() == 0.0
    bm.check_integrity()


def test_can_allocate_never_later_and_watermark():
    bm = BlockManager(block_size=4, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.2)
    assert bm.watermark_blocks == 2
    assert bm.can_allocate(make_group("big", 4 * 9)) is AllocStatus.NEVER  # 9 > 10 - 2
    assert bm.can_allocate(make_group("max", 4 * 8)) is AllocStatus.OK
    admit(bm, make_group("a", 4 * 5))  # 5 free left
    assert bm.can_allocate(make_group("b", 4 * 3)) is AllocStatus.OK  # 5 - 3 >= 2
    assert bm.can_allocate(make_group("c", 4 * 4)) is AllocStatus.LATER  # 5 - 4 < 2


def test_fork_then_copy_on_write():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    parent = admit(bm, make_group("a", 6))
    compute(bm, parent)
    parent.output_token_ids.append(1)  # 7 tokens: the next write lands in the partial block 1
    child = parent.fork(new_seq_id(), 1, "1_a")
    bm.fork(parent, child)
    assert bm.get_block_table(child) == bm.get_block_table(parent) == [0, 1]
    bm.check_integrity()
    copies = bm.append_slots(parent)
    assert copies == [(1, 2)] and bm.get_block_table(parent) == [0, 2]
    assert bm.append_slots(child) == []  # now the only holder of block 1: writes in place
    assert bm.get_block_table(child) == [0, 1]
    bm.check_integrity()
    bm.free(parent)
    bm.free(child)
    assert bm.get_num_free_gpu_blocks() == 8


def test_append_grows_table_at_block_boundary():
    full = BlockManager(block_size=4, num_gpu_blocks=2, num_cpu_blocks=0, watermark=0.0)
    group = make_group("a", 8)
    seq = admit(full, group)
    compute(full, seq)
    seq.output_token_ids.append(1)  # the 9th token needs a 3rd block
    assert full.num_append_blocks(group) == 1
    assert full.can_append_slots(group) is False  # none free
    bm = BlockManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=0, watermark=0.0)
    group = make_group("b", 8)
    seq = admit(bm, group)
    compute(bm, seq)
    seq.output_token_ids.append(1)
    assert bm.can_append_slots(group) is True
    assert bm.append_slots(seq) == [] and len(bm.get_block_table(seq)) == 3


def test_swap_maps_shared_blocks_once():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)
    group = make_group("a", 6, n=2)
    parent = admit(bm, group)
    child = parent.fork(new_seq_id(), 1, "1_a")
    group.seqs.append(child)
    bm.fork(parent, child)
    assert bm.can_swap_out(group)
    out_map = bm.swap_out(group)
    assert sorted(out_map) == [0, 1]  # two physical blocks, each once
    for s in group.seqs:
        s.status = SWAPPED
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 6
    bm.check_integrity()
    assert bm.can_swap_in(group)
    in_map = bm.swap_in(group)
    assert sorted(in_map) == sorted(out_map.values())
    assert bm.get_block_table(parent) == bm.get_block_table(child)
    assert bm.get_num_free_cpu_blocks() == 8
    bm.check_integrity()


def test_prefix_hit_skips_computed_blocks_and_counts_tokens():
    bm = BlockManager(
        block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=True
    )
    prompt = list(range(10))
    a = admit(bm, make_group("a", 0, prompt=prompt))
    compute(bm, a)
    b_group = make_group("b", 0, prompt=prompt[:8] + [50, 51, 52])
    b = admit(bm, b_group)
    assert b.num_computed_tokens == 8
    assert bm.get_block_table(b)[:2] == bm.get_block_table(a)[:2]
    assert bm.get_block_table(b)[2] != bm.get_block_table(a)[2]
    assert bm.num_prefix_cache_queries == 10 + 11 and bm.num_prefix_cache_hits == 8
    bm.check_integrity()


def test_whole_prompt_hit_recomputes_last_block():
    bm = BlockManager(
        block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=True
    )
    prompt = list(range(8))
    a = admit(bm, make_group("a", 0, prompt=prompt))
    compute(bm, a)
    b = admit(bm, make_group("b", 0, prompt=prompt))
    assert b.num_computed_tokens == 4  # one token at least is computed, in a private block
    ta, tb = bm.get_block_table(a), bm.get_block_table(b)
    assert tb[0] == ta[0] and tb[1] != ta[1]
    assert bm.append_slots(b) == []
    bm.check_integrity()


def test_freed_cached_blocks_are_free_and_evicted_lru():
    bm = BlockManager(
        block_size=4, num_gpu_blocks=4, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=True
    )
    old = admit(bm, make_group("old", 0, prompt=[1] * 4 + [2]))
    compute(bm, old)
    new = admit(bm, make_group("new", 0, prompt=[3] * 4 + [4]))
    compute(bm, new)
    old_block, new_block = bm.get_block_table(old)[0], bm.get_block_table(new)[0]
    bm.free(old)
    bm.free(new)
    assert bm.get_num_free_gpu_blocks() == 4  # cached blocks count as free
    # three fresh blocks: two plain free ones, then the least recently used cached block
    x = admit(bm, make_group("x", 12))
    assert old_block in bm.get_block_table(x) and new_block not in bm.get_block_table(x)
    bm.free(x)
    miss = admit(bm, make_group("miss", 0, prompt=[1] * 4 + [9]))
    assert miss.num_computed_tokens == 0  # evicted
    hit = admit(bm, make_group("hit", 0, prompt=[3] * 4 + [9]))
    assert hit.num_computed_tokens == 4 and bm.get_block_table(hit)[0] == new_block
    bm.check_integrity()


def test_pool_integrity_detects_leak():
    pool = BlockPool(4)
    b = pool.allocate()
    try:
        pool.check_integrity({}, "device")
    except AssertionError as e:
        assert f"block {b}" in str(e)
    else:
        raise AssertionError("a leaked block went unnoticed")


def test_core_never_imports_torch():
    import subprocess
    import sys

    # the scheduler, its update and both boundary messages (a remote worker unpickles them)
    code = ("import sys, tessera.core.scheduler, tessera.core.runner_output, "
            "tessera.core.scheduler_output, tessera.core.core_output; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
