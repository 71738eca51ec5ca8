"""Packed weights copied onto memory advised for huge pages (tessera/kernels/hugepages.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from tessera.kernels.hugepages import in_huge_pages


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


def test_small_tensors_stay_where_they_are():
    small = torch.ones(1000)
    assert in_huge_pages(small) is small
