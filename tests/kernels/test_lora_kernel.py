"""The batched LoRA kernel (tessera/kernels/lora.cpp) against a float64 reference and against its
torch fallback; a row's result does not depend on the other segments of the step (bit for bit);
slots the step does not name are never read, weights past a slot's rank never used; bad indices
are refused."""

from __future__ import annotations

import os

import pytest
import torch

from tessera.kernels.lora import lora_add_reference, lora_kernel_for

pytestmark = pytest.mark.usefixtures("isa")  # once per instruction set (conftest.py)

CPU = torch.device("cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
K, MAX_RANK, NUM_SLOTS = 100, 16, 3  # K not a multiple of a vector: the tail path runs
OUT = [40, 24, 24]  # a fused projection of three targets


def _kernel(dtype):
    module = lora_kernel_for(CPU, dtype)
    if module is None:
        if os.environ.get("TESSERA_DISABLE_CPP_KERNELS"):
            pytest.skip("TESSERA_DISABLE_CPP_KERNELS is set")
        pytest.fail("LoRA C++ kernel did not build for this ISA (see the warning log)")
    return module


def _bank(ranks: list[list[int]]):
    """Random stacked weights in the kernel's layout, with the given rank per slot and target."""
    gen = torch.Generator().manual_seed(7)
    num_targets = len(OUT)
    offsets = [0, *torch.tensor(OUT).cumsum(0).tolist()]
    a = torch.randn(NUM_SLOTS, K, num_targets * MAX_RANK, generator=gen)  # A^T
    bt = torch.randn(NUM_SLOTS, MAX_RANK * offsets[-1], generator=gen)
    return a, bt, ranks, offsets


def _reference64(y, x, segments, a, bt, ranks, offsets):
    out = y.double().clone()
    for start, end, slot in segments:
        for t, rank in enumerate(ranks[slot]):
            o0, o1 = offsets[t], offsets[t + 1]
            a_t = a[slot, :, t * MAX_RANK : t * MAX_RANK + rank].double()  # [K, rank]
            bt_t = bt[slot, MAX_RANK * o0 : MAX_RANK * o1].view(MAX_RANK, o1 - o0)[:rank].double()
            out[start:end, o0:o1] += (x[start:end].double() @ a_t) @ bt_t
    return out


def _call(module, y, x, segments, a, bt, ranks, offsets):
    module.lora_add_(y, x, torch.tensor(segments, dtype=torch.long).view(-1, 3), a, bt,
                     torch.tensor(ranks, dtype=torch.long), torch.tensor(offsets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_match_the_float64_reference_and_the_torch_path(dtype):
    module = _kernel(dtype)
    ranks = [[16, 8, 0], [5, 5, 5], [16, 16, 16]]  # a target left out; an odd rank
    a, bt, ranks, offsets = _bank(ranks)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(23, K, generator=gen).to(dtype)
    y0 = torch.randn(23, offsets[-1], generator=gen).to(dtype)
    # rows 0-6 under slot 2, 7-8 the base (untouched), 9 slot 0, 10-22 slot 1
    segments = [(0, 7, 2), (9, 10, 0), (10, 23, 1)]
    y = y0.clone()
    _call(module, y, x, segments, a, bt, ranks, offsets)
    ref = _reference64(y0, x, segments, a, bt, ranks, offsets)
    rel = (y.double() - ref).abs().max() / ref.abs().max()
    assert rel <= TOL[dtype], rel.item()
    assert torch.equal(y[7:9], y0[7:9])  # rows of no segment
    assert torch.equal(y[9, 40 + 24 :], y0[9, 40 + 24 :])  # slot 0 leaves v_proj out
    y_torch = y0.clone()
    lora_add_reference(y_torch, x, segments, a, bt, ranks, offsets)
    rel = (y.double() - y_torch.double()).abs().max() / ref.abs().max()
    assert rel <= TOL[dtype], rel.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_its_batch(dtype):
    """Each row alone equals the same row inside a step of mixed segments, bit for bit."""
    module = _kernel(dtype)
    a, bt, ranks, offsets = _bank([[16, 16, 16], [3, 7, 16], [9, 0, 2]])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(30, K, generator=gen).to(dtype)
    y0 = torch.randn(30, offsets[-1], generator=gen).to(dtype)
    segments = [(0, 11, 1), (11, 12, 0), (12, 30, 2)]
    y = y0.clone()
    _call(module, y, x, segments, a, bt, ranks, offsets)
    for start, end, slot in segments:
        for row in range(start, end):
            alone = y0[row : row + 1].clone()
            _call(module, alone, x[row : row + 1], [(0, 1, slot)], a, bt, ranks, offsets)
            assert torch.equal(alone[0], y[row]), (row, slot)


def test_slots_the_step_does_not_name_are_never_read():
    module = _kernel(torch.float32)
    a, bt, ranks, offsets = _bank([[16, 16, 16]] * NUM_SLOTS)
    x = torch.randn(8, K)
    y0 = torch.randn(8, offsets[-1])
    y = y0.clone()
    _call(module, y, x, [(0, 8, 1)], a, bt, ranks, offsets)
    a[0].fill_(float("nan"))
    bt[2].fill_(float("nan"))
    again = y0.clone()
    _call(module, again, x, [(0, 8, 1)], a, bt, ranks, offsets)
    assert torch.equal(again, y)
    # weights past a slot's rank never reach the output
    a[1, :, MAX_RANK - 1].fill_(float("nan"))  # q_proj's last rank: used at rank 16, not at 15
    short = [[16, 16, 16], [15, 16, 16], [16, 16, 16]]
    fine = y0.clone()
    _call(module, fine, x, [(0, 8, 1)], a, bt, short, offsets)
    assert not fine.isnan().any()


def test_bad_indices_are_refused():
    module = _kernel(torch.float32)
    a, bt, ranks, offsets = _bank([[1, 1, 1]] * NUM_SLOTS)
    x, y = torch.randn(4, K), torch.zeros(4, offsets[-1])
    with pytest.raises(RuntimeError, match="slot outside the bank"):
        _call(module, y, x, [(0, 4, NUM_SLOTS)], a, bt, ranks, offsets)
    with pytest.raises(RuntimeError, match="disjoint row ranges"):
        _call(module, y, x, [(0, 3, 0), (2, 4, 1)], a, bt, ranks, offsets)
    with pytest.raises(RuntimeError, match="disjoint row ranges"):
        _call(module, y, x, [(0, 5, 0)], a, bt, ranks, offsets)
    with pytest.raises(RuntimeError, match="rank outside"):
        _call(module, y, x, [(0, 4, 0)], a, bt, [[MAX_RANK + 1, 1, 1]] * NUM_SLOTS, offsets)
