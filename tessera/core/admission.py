"""Why a request can never run: checked when it reaches the head of the waiting queue, so that it is
rejected at once with a reason instead of waiting forever; and the configuration rule that keeps
such rejections from stranding work: the cache holds at least one request of max_model_len."""

from __future__ import annotations

from tessera.config import EngineConfig, GiB, SchedulerConfig
from tessera.core.block_manager import BlockManager, num_peak_blocks, num_watermark_blocks
from tessera.core.kv_cache_groups import cache_group_windows
from tessera.sequence import SequenceGroup, SequenceStatus
from tessera.utils import cdiv


def reject_reason(group: SequenceGroup, cfg: SchedulerConfig) -> str | None:
    """A limit of the configuration the request exceeds, or None."""
    for seq in group.seqs:
        if not seq.is_finished() and seq.get_len() > cfg.max_model_len:
            if seq.get_output_len():
                return (
                    f"sequence has {seq.get_len()} tokens (prompt + output), more than "
                    f"max_model_len {cfg.max_model_len}"
                )
            return f"prompt has {seq.get_len()} tokens, more than max_model_len {cfg.max_model_len}"
    n = group.max_num_running_seqs()
    if n > cfg.max_num_seqs:
        return f"request needs {n} sequences at once, more than max_num_seqs {cfg.max_num_seqs}"
    if n > cfg.max_num_batched_tokens:
        return (
            f"request needs {n} sequences at once, more than max_num_batched_tokens "
            f"{cfg.max_num_batched_tokens}"
        )
    return None


def never_fits_reason(group: SequenceGroup, bm: BlockManager) -> str:
    """The message for a request whose blocks exceed even an empty device pool."""
    num_tokens = sum(s.get_len() for s in group.seqs if s.status is SequenceStatus.WAITING)
    if bm.never_fits(group) == "draft":
        return (
            f"request needs {cdiv(num_tokens, bm.block_size)} blocks of the draft model's KV "
            f"pool ({num_tokens} tokens, block size {bm.block_size}), more than its "
            f"{bm.num_draft_gpu_blocks} blocks less the watermark of {bm.draft_watermark_blocks}"
        )
    groups = f", in {bm.num_groups} KV cache groups" if bm.num_groups > 1 else ""
    return (
        f"request needs {bm.num_required_blocks(group)} KV blocks ({num_tokens} tokens, block "
        f"size {bm.block_size}{groups}), more than the {bm.num_gpu_blocks} device blocks less the "
        f"watermark of {bm.watermark_blocks}"
    )


def cache_fit(num_seqs: int, num_tokens: int, block_size: int, num_gpu_blocks: int,
              watermark: float, num_groups: int = 1,
              group_windows: tuple[int | None, ...] = (),
              max_chunk_tokens: int | None = None) -> tuple[int, int, int]:
    """(blocks `num_seqs` sequences of `num_tokens` need at most, each whole; blocks the device
    pool gives admissions, less the watermark; the watermark). The one home of "does it fit in
    an empty cache": the engine's start-up check and its n > 1 check both ask it.
    `group_windows`: each KV cache group's window (default: `num_groups` full groups); a window
    group holds only its window and one chunk of `max_chunk_tokens` (the scheduler's
    max_num_batched_tokens), `num_peak_blocks`."""
    windows = group_windows or (None,) * num_groups
    watermark_blocks = num_watermark_blocks(num_gpu_blocks, watermark)
    return (
        num_seqs * num_peak_blocks(num_tokens, block_size, windows, max_chunk_tokens),
        num_gpu_blocks - watermark_blocks,
        watermark_blocks,
    )


def check_cache_holds_max_model_len(
    num_gpu_blocks: int, block_size: int, watermark: float, max_model_len: int,
    block_bytes: int | None = None, overridden: bool = False, num_groups: int = 1,
    group_windows: tuple[int | None, ...] = (), max_chunk_tokens: int | None = None,
) -> None:
    """Refuse a configuration whose device KV pool cannot hold one request of `max_model_len`
    tokens (vLLM refuses it too): such a request would be admitted, run, and be rejected only
    when it outgrows the pool (or after a recompute), its work thrown away. ValueError with the
    numbers and the fix. `group_windows` and `max_chunk_tokens` as for `cache_fit`: a window
    group needs only its window and a chunk."""
    needed, usable, watermark_blocks = cache_fit(1, max_model_len, block_size, num_gpu_blocks,
                                                 watermark, num_groups, group_windows,
                                                 max_chunk_tokens)
    if needed <= usable:
        return
    windows = group_windows or (None,) * num_groups
    num_groups = len(windows)
    # the longest request that does fit (a footprint never shrinks with the length)
    lo, hi = 0, max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if num_peak_blocks(mid, block_size, windows, max_chunk_tokens) <= usable:
            lo = mid
        else:
            hi = mid - 1
    fits = lo // block_size * block_size
    size = ""
    if block_bytes is not None:
        have = num_gpu_blocks * block_bytes / GiB
        want = (needed + watermark_blocks) * block_bytes / GiB
        size = f" ({have:.3g} GiB; {want:.3g} GiB would do)"
    raise_flag = "--num-gpu-blocks-override" if overridden else "--kv-cache-space"
    groups = f" in {num_groups} KV cache groups" if num_groups > 1 else ""
    raise ValueError(
        f"the KV cache cannot hold one request of --max-model-len {max_model_len} tokens: it "
        f"needs {needed} blocks of {block_size} tokens{groups}, but the cache has {num_gpu_blocks} "
        f"blocks{size}, of which {usable} are usable ({watermark_blocks} kept free as the "
        f"watermark), room for {fits} tokens. Raise {raise_flag} or lower --max-model-len "
        f"(to at most {fits})"
    )


def num_draft_pool_blocks(num_gpu_blocks: int, block_size: int, watermark: float,
                          max_model_len: int, group_windows: tuple[int | None, ...],
                          max_chunk_tokens: int | None) -> int:
    """Blocks of the draft model's own KV pool (speculative decoding with a window), 0 without
    a window (the draft then follows the target's table, one block per target block). The
    draft attends to the whole context, so it holds every token block of a request while the
    target's window groups hold only their window: the pool gets room for as many requests of
    `max_model_len` as the target's pool of `num_gpu_blocks` (the rule of the draft-follows
    case, where both pools have the same blocks), and at least one."""
    if all(w is None for w in group_windows):
        return 0
    target = num_peak_blocks(max_model_len, block_size, group_windows, max_chunk_tokens)
    per_request = cdiv(max_model_len, block_size)
    n = max(cdiv(num_gpu_blocks * per_request, target), per_request)
    while n - num_watermark_blocks(n, watermark) < per_request:
        n += 1
    return n


def draft_pool_blocks(config: EngineConfig, num_gpu_blocks: int) -> int:
    """Blocks of the draft model's own KV pool for an engine whose target pool has
    `num_gpu_blocks`: 0 without a draft model or without a window, else
    `num_draft_pool_blocks`. The engine's loader and the simulator both ask it."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return 0
    cache = config.cache
    return num_draft_pool_blocks(
        num_gpu_blocks, cache.block_size, cache.watermark, config.model.max_model_len,
        cache_group_windows(cache.sliding_window, cache.layer_windows),
        config.scheduler.max_num_batched_tokens,
    )
