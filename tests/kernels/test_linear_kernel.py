"""The linear kernel against a float64 reference, its row independence, and `Linear` on top of
it."""

from __future__ import annotations

import os

import pytest
import torch

from tessera.kernels import build
from tessera.kernels.linear import PackedLinearWeight, linear_kernel_supported
from tessera.model.layers import Linear

pytestmark = pytest.mark.usefixtures("isa")  # once per instruction set (conftest.py)
NATIVE = build.supported_isas()[0]

# bf16 inputs are exact in fp32; the kernel accumulates in fp32 and rounds once to bf16.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _require(weight: torch.Tensor) -> None:
    if not linear_kernel_supported(weight):
        if os.environ.get("TESSERA_DISABLE_CPP_KERNELS"):
            pytest.skip("TESSERA_DISABLE_CPP_KERNELS is set")
        pytest.fail("linear C++ kernel did not build for this ISA (see the warning log)")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 64), (100, 96), (49, 576), (3072, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(dtype, n, k, bias, isa):
    if isa != NATIVE and n * k > 100_000:
        pytest.skip("large shapes run on the CPU's own ISA only (test time)")
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    _require(w)
    packed = PackedLinearWeight(w, b)
    for m in (1, 2, 7, 8, 9, 40, 96, 97, 150):
        x = torch.randn(m, k, generator=gen).to(dtype)
        got = packed(x)
        assert got.shape == (m, n) and got.dtype == dtype
        ref = _reference(x, w, b)
        rel = (got.double() - ref).abs().max() / ref.abs().max()
        assert rel <= TOL[dtype], (m, rel.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_result_does_not_depend_on_the_batch(dtype):
    """Each output is one dot product in K order: bitwise the same alone, among a few other rows, or
    inside a prefill-sized batch (this is what keeps bf16 greedy decoding invariant)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 128, generator=gen).to(dtype)
    _require(w)
    packed = PackedLinearWeight(w)
    x = torch.randn(300, 128, generator=gen).to(dtype)
    batched = packed(x)
    for i in (0, 7, 8, 36, 96, 299):
        assert torch.equal(packed(x[i : i + 1]), batched[i : i + 1])
    assert torch.equal(packed(x[5:45]), batched[5:45])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [100, 576])
def test_decode_batch_rows_equal_rows_alone(dtype, k):
    """Decode batches (M = 7-64) take the K-sliced tiles (and AMX in bf16 where the CPU has it),
    a lone row the single-tile path: the same sums bit for bit. K = 100 leaves a partial slice and
    a K tail after the last 32-wide AMX step."""
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(150, k, generator=gen).to(dtype)
    b = torch.randn(150, generator=gen).to(dtype)
    _require(w)
    packed = PackedLinearWeight(w, b)
    x = torch.randn(64, k, generator=gen).to(dtype)
    alone = torch.cat([packed(x[i : i + 1]) for i in range(64)])
    ref = _reference(x, w, b)
    assert ((alone.double() - ref).abs().max() / ref.abs().max()).item() <= TOL[dtype]
    for m in (7, 9, 16, 17, 33, 64):
        assert torch.equal(packed(x[:m]), alone[:m]), f"M={m}"


def test_strided_rows_and_leading_dims():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=gen)
    _require(w)
    packed = PackedLinearWeight(w)
    wide = torch.randn(6, 100, generator=gen)
    x = wide[:, 10:74]  # rows 100 apart, last dim contiguous
    assert torch.allclose(packed(x), x @ w.T, atol=1e-5)
    x3 = torch.randn(2, 3, 64, generator=gen)
    assert packed(x3).shape == (2, 3, 40)
    assert torch.allclose(packed(x3), x3 @ w.T, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_full_row_tiles_equal_rows_alone(dtype):
    """Rows 130 apart in whole 8-row tiles, regrouped 16 units at a time with a tail after the last
    16 (K = 72: 4 x 16 + 8 fp32 values, 2 x 16 + 4 bf16 pairs): each row's result is the lone
    row's (M = 1 reads its row unregrouped), bit for bit."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(60, 72, generator=gen).to(dtype)
    _require(w)
    packed = PackedLinearWeight(w)
    x = torch.randn(24, 130, generator=gen).to(dtype)[:, 40:112]
    got = packed(x)
    alone = torch.cat([packed(x[i : i + 1].contiguous()) for i in range(24)])
    assert torch.equal(got, alone)
    ref = _reference(x, w, None)
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() <= TOL[dtype]


def test_odd_k_in_bf16_is_not_served():
    """vdpbf16ps works on pairs along K: an odd K goes to oneDNN instead (or to F.linear on a
    CPU where oneDNN packs no bf16)."""
    from tessera.model.layers import _mkldnn_packs

    w = torch.randn(32, 33).to(torch.bfloat16)
    assert not linear_kernel_supported(w)
    lin = Linear(w)
    assert lin.kernel is None and (lin.packed is not None) == _mkldnn_packs(torch.bfloat16)
    x = torch.randn(3, 33).to(torch.bfloat16)
    assert torch.allclose(lin(x).float(), x.float() @ w.float().T, atol=0.1)


@pytest.mark.parametrize("rows", [1, 97, 300])
def test_linear_uses_the_kernel_and_agrees(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(130, 64, generator=gen)
    b = torch.randn(130, generator=gen)
    _require(w)
    lin = Linear(w, b)
    assert lin.kernel is not None and lin.weight is None  # the panels are the only copy
    x = torch.randn(rows, 64, generator=gen)
    assert torch.allclose(lin(x).double(), _reference(x, w, b), atol=1e-4)
