"""CacheEngine: the block-count math, the per-layer views, and swap and copy moving K and V bit
for bit (compared as raw bits, so -0.0 and NaN payloads would count too) across every layer."""

from __future__ import annotations

import pytest
import torch

from tessera.config import GiB
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 3, 2, 4, 4
NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 8, 6


def spec(dtype: torch.dtype = torch.float32) -> KVCacheSpec:
    return KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, for exact comparisons."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def filled(dtype: torch.dtype) -> CacheEngine:
    """An engine whose device and CPU pools hold distinct random values in every slot."""
    engine = CacheEngine(spec(dtype), NUM_GPU_BLOCKS, NUM_CPU_BLOCKS, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    engine.gpu_cache.copy_(torch.randn(engine.gpu_cache.shape, generator=gen))
    engine.cpu_cache.copy_(torch.randn(engine.cpu_cache.shape, generator=gen))
    return engine


def block(cache: torch.Tensor, block_id: int) -> torch.Tensor:
    """One block of every layer, K and V: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
    return bits(cache[:, :, block_id])


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


def test_block_bytes_and_num_blocks_for():
    s = spec()
    # K and V, 3 layers, 4 slots, 2 heads, 4 dims, 4 bytes
    assert s.block_bytes == 2 * 3 * 4 * 2 * 4 * 4 == 768
    assert spec(torch.bfloat16).block_bytes == 384
    assert s.num_blocks_for(1) == GiB // 768
    assert s.num_blocks_for(10 * 768 / GiB) == 10  # exact: a power-of-two scaling
    assert s.num_blocks_for((10 * 768 - 1) / GiB) == 9  # a partial block does not count
    assert s.num_blocks_for(0) == 0
    assert spec(torch.bfloat16).num_blocks_for(1) == 2 * s.num_blocks_for(1)


@DTYPES
def test_pools_take_block_bytes_per_block(dtype):
    engine = CacheEngine(spec(dtype), NUM_GPU_BLOCKS, NUM_CPU_BLOCKS, torch.device("cpu"))
    assert engine.gpu_cache.nbytes == NUM_GPU_BLOCKS * engine.spec.block_bytes
    assert engine.cpu_cache.nbytes == NUM_CPU_BLOCKS * engine.spec.block_bytes
    assert engine.gpu_cache.dtype == engine.cpu_cache.dtype == dtype
    assert not engine.gpu_cache.any()  # zeros: padding slots are read before they are masked


def test_kv_caches_are_views_of_the_device_pool():
    engine = filled(torch.float32)
    caches = engine.kv_caches
    assert len(caches) == NUM_LAYERS
    for k, v in caches:
        assert k.shape == v.shape == (NUM_GPU_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    # what the model writes through a view is what swap and copy move
    caches[2][1][5, 3, 1].fill_(7.0)
    assert (engine.gpu_cache[2, 1, 5, 3, 1] == 7.0).all()


def test_kv_caches_views_are_built_once_per_pool_tensor():
    engine = filled(torch.float32)
    assert engine.kv_caches is engine.kv_caches  # not rebuilt every step
    # a pool replaced by a larger one (a draft model's cache grows so): views of the new one
    engine.gpu_cache = torch.cat([engine.gpu_cache, torch.zeros_like(engine.gpu_cache)], dim=2)
    k, v = engine.kv_caches[1]
    assert k.shape[0] == 2 * NUM_GPU_BLOCKS
    assert k.data_ptr() == engine.gpu_cache[1, 0].data_ptr()
    assert v.data_ptr() == engine.gpu_cache[1, 1].data_ptr()


@DTYPES
def test_swap_out_then_in_restores_blocks_into_other_device_blocks(dtype):
    engine = filled(dtype)
    before_gpu = bits(engine.gpu_cache).clone()
    before_cpu = bits(engine.cpu_cache).clone()
    out = {0: 2, 3: 0, 5: 4}  # device -> CPU
    engine.swap_out(out)
    for g, c in out.items():
        assert torch.equal(block(engine.cpu_cache, c), before_gpu[:, :, g])
    for c in set(range(NUM_CPU_BLOCKS)) - set(out.values()):
        assert torch.equal(block(engine.cpu_cache, c), before_cpu[:, :, c])
    assert torch.equal(bits(engine.gpu_cache), before_gpu)  # swap_out only reads the device

    engine.gpu_cache.zero_()  # the device blocks are reused by others meanwhile
    back = {2: 6, 0: 1, 4: 7}  # CPU -> device, each into a different device block
    engine.swap_in(back)
    for c, g in back.items():
        src = next(d for d, cpu in out.items() if cpu == c)
        assert torch.equal(block(engine.gpu_cache, g), before_gpu[:, :, src]), (c, g)
    for g in set(range(NUM_GPU_BLOCKS)) - set(back.values()):
        assert not engine.gpu_cache[:, :, g].any()  # untouched


@DTYPES
def test_copy_duplicates_blocks_in_every_layer(dtype):
    engine = filled(dtype)
    before = bits(engine.gpu_cache).clone()
    pairs = [(1, 4), (2, 5), (1, 6)]  # one source may feed several destinations
    engine.copy(pairs)
    for src, dst in pairs:
        assert torch.equal(block(engine.gpu_cache, dst), before[:, :, src]), (src, dst)
    for b in {0, 1, 2, 3, 7}:
        assert torch.equal(block(engine.gpu_cache, b), before[:, :, b])
    assert torch.equal(bits(engine.cpu_cache), bits(filled(dtype).cpu_cache))


def test_copy_reads_every_source_before_writing():
    engine = filled(torch.float32)
    before = bits(engine.gpu_cache).clone()
    engine.copy([(0, 1), (1, 2)])  # a chain: block 2 gets block 1 as it was, not block 0
    assert torch.equal(block(engine.gpu_cache, 1), before[:, :, 0])
    assert torch.equal(block(engine.gpu_cache, 2), before[:, :, 1])


def test_empty_mappings_change_nothing():
    engine = filled(torch.float32)
    gpu, cpu = engine.gpu_cache.clone(), engine.cpu_cache.clone()
    engine.swap_in({})
    engine.swap_out({})
    engine.copy([])
    assert torch.equal(engine.gpu_cache, gpu) and torch.equal(engine.cpu_cache, cpu)
