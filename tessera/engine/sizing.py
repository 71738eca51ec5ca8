"""Two start-up helpers both engine builders share (loading.py in process, tp_loading.py over
tensor-parallel ranks): the KV pools' sizes from the flags, and the resolved configuration as
one log line.
"""

from __future__ import annotations

import dataclasses

from tessera.core.admission import check_cache_holds_max_model_len
from tessera.core.kv_cache_groups import cache_group_windows, num_pool_blocks_for_override
from tessera.worker.cache_engine import KVCacheSpec


def size_kv_pools(config, spec: KVCacheSpec) -> tuple[int, int]:
    """(device blocks, swap blocks) of one worker from --kv-cache-space/--swap-space (GiB per
    worker) or --num-gpu-blocks-override; refuses a pool that cannot hold one max_model_len
    request. With KV cache groups a block holds one group's layers, so the same memory holds
    `num_groups` times more of them; --num-gpu-blocks-override keeps counting blocks of every
    layer (the memory it always meant), so it gives `num_groups` pool blocks each."""
    override = config.cache.num_gpu_blocks_override
    num_gpu_blocks = (
        num_pool_blocks_for_override(override, config.cache.layer_windows) if override
        else spec.num_blocks_for(config.cache.kv_cache_space)
    )
    if num_gpu_blocks < 1:
        raise ValueError(
            f"--kv-cache-space {config.cache.kv_cache_space} GiB holds no block of "
            f"{spec.block_bytes} bytes: raise it"
        )
    check_cache_holds_max_model_len(
        num_gpu_blocks, config.cache.block_size, config.cache.watermark,
        config.model.max_model_len, spec.block_bytes,
        overridden=config.cache.num_gpu_blocks_override is not None,
        group_windows=cache_group_windows(config.cache.sliding_window,
                                          config.cache.layer_windows),
        max_chunk_tokens=config.scheduler.max_num_batched_tokens,
    )
    return num_gpu_blocks, spec.num_blocks_for(config.cache.swap_space)


def describe_config(config) -> str:
    """Every field of the resolved `EngineConfig` (defaults filled in, limits derived from the
    model) as `section.field=value`, one line: what the engine really runs with."""
    parts = []
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if not dataclasses.is_dataclass(value):  # an optional part that is off (speculative)
            parts.append(f"{section.name}={value!r}")
            continue
        for f in dataclasses.fields(value):
            parts.append(f"{section.name}.{f.name}={getattr(value, f.name)!r}")
    return ", ".join(parts)
