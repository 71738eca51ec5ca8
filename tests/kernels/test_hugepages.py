"""Packed weights and the KV cache on memory advised for huge pages
(tessera/kernels/hugepages.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from tessera.kernels.hugepages import in_huge_pages, zeros_in_huge_pages


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_HUGEPAGE) is Linux's")
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16], ids=str)
def test_a_large_tensor_is_copied_onto_a_2_mib_boundary(dtype):
    t = torch.randn(3000, 1024).to(dtype)  # 3-12 MB: over the size limit for every dtype
    if t.numel() * t.element_size() < 8 << 20:
        t = torch.randn(6000, 2048).to(dtype)
    out = in_huge_pages(t)
    assert out is not t and out.data_ptr() % (2 << 20) == 0
    assert out.shape == t.shape and out.dtype == t.dtype and torch.equal(out, t)
    t.zero_()  # a copy, not a view of the source
    assert not torch.equal(out, t)
    del t
    assert out.sum().item() != 0  # the mapping outlives the source


def test_tiny_tensors_stay_where_they_are():
    small = torch.ones(1000)
    assert in_huge_pages(small) is small


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_tensors_below_8_mib_share_huge_page_mappings_in_copy_order():
    a = torch.randn(300, 1024)  # 1.2 MB
    b = torch.randint(0, 255, (70_001,), dtype=torch.uint8)  # odd size: the next stays aligned
    c = torch.randn(100, 1024).to(torch.bfloat16)
    outs = [in_huge_pages(t) for t in (a, b, c)]
    for t, out in zip((a, b, c), outs, strict=True):
        assert out is not t and out.shape == t.shape and out.dtype == t.dtype
        assert torch.equal(out, t) and out.data_ptr() % 64 == 0
    # consecutive slices of one mapping (a new one only where the last is full)
    starts = [out.data_ptr() for out in outs]
    assert starts[1] == starts[0] + a.nbytes or starts[1] % (2 << 20) == 0
    a.zero_()
    del a
    assert outs[0].abs().sum().item() > 0  # a copy that outlives the source
    outs[1].zero_()  # writing one slice leaves its neighbours alone
    assert torch.equal(outs[2], c) and outs[0].abs().sum().item() > 0


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_a_large_zero_tensor_starts_on_a_2_mib_boundary():
    out = zeros_in_huge_pages((5, 1024, 1024), torch.bfloat16, torch.device("cpu"))  # 10 MiB
    assert out.data_ptr() % (2 << 20) == 0 and out.is_contiguous()
    assert out.shape == (5, 1024, 1024) and out.dtype == torch.bfloat16
    assert not out.any()
    out[4, 1023, 1023] = 1.0  # the whole extent is writable
    assert out.sum().item() == 1.0


def test_small_zero_tensors_come_from_torch():
    out = zeros_in_huge_pages((1000,), torch.float32, torch.device("cpu"))
    assert out.dtype == torch.float32 and not out.any()


def test_the_kv_cache_is_zero_and_on_huge_pages_where_linux_allows():
    from tessera.worker.cache_engine import CacheEngine, KVCacheSpec

    cache = CacheEngine(KVCacheSpec(4, 2, 64, 16, torch.bfloat16), 1024, 0,
                        torch.device("cpu")).gpu_cache  # 32 MiB
    assert not cache.any()
    if sys.platform == "linux":
        assert cache.data_ptr() % (2 << 20) == 0
