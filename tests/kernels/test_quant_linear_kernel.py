"""The quantized linear kernel (tessera/kernels/quant_linear.*) against gguf's own dequantization.

Per GGUF type: the packed copy dequantizes to gguf.quants.dequantize's values bit for bit; the
kernel's y matches a float64 matmul on those values; in fp32 it equals the dense kernel on them
bit for bit (so --quantization gguf cannot change a token), in bf16 (the block-sum form) it is at
least as close to float64 as the dense bf16 kernel; and a row's output is the same alone or in a
batch of any size (fp32: on both ways through a panel, registers below DENSE_MIN_ROWS, dense above).
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from quant_weights import random_weight

from tessera.kernels import quant_linear as ql
from tessera.kernels.linear import PackedLinearWeight, linear_kernel_supported

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
CPU = torch.device("cpu")
# (N, K): N not a multiple of the 48-wide panel, K multiple of 256 for the K-quants
SHAPES = [(1, 256), (47, 256), (49, 512), (130, 768)]


pytestmark = pytest.mark.usefixtures("isa")  # once per instruction set (conftest.py)


def _kernel_or_skip(dtype):
    if not ql.quant_kernel_supported(dtype, CPU):
        if os.environ.get("TESSERA_DISABLE_CPP_KERNELS"):
            pytest.skip("TESSERA_DISABLE_CPP_KERNELS is set")
        pytest.fail(f"quantized kernel for {dtype} did not build for this ISA (see the log)")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_weights_dequantize_to_gguf_values(qtype):
    for n, k in SHAPES:
        w = random_weight(qtype, n, k)
        ref = torch.from_numpy(
            gguf.quants.dequantize(w.data, qtype).reshape(n, k).astype(np.float32)
        )
        for pairs in (False, True):  # both code layouts (fp32 and bf16 activations)
            part = w.pack(pairs=pairs)
            assert part.packed.numel() == part.fmt.packed_bytes(n, k)
            assert torch.equal(ql.dequantize_packed(part.fmt, part.packed, n, k, pairs), ref)
            ids = torch.tensor([0, n - 1, n // 2, 0])
            assert torch.equal(ql.dequantize_rows(part.fmt, part.packed, k, ids, pairs), ref[ids])
            other = ql.with_layout(part, not pairs)  # a repack gives the other packing exactly
            assert torch.equal(other.packed, w.pack(pairs=not pairs).packed)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_row_lookup_kernel_gives_the_gguf_values_in_each_dtype(qtype):
    """The embedding lookup's C++ path (lookup_rows) against gguf's dequantization, cast as torch
    casts, for both code layouts; an id past the packed rows is an error, not a read."""
    for n, k in SHAPES:
        w = random_weight(qtype, n, k, seed=1)
        ref = torch.from_numpy(
            gguf.quants.dequantize(w.data, qtype).reshape(n, k).astype(np.float32)
        )
        ids = torch.tensor([n - 1, 0, n // 2, n - 1, 0])
        for pairs in (False, True):
            part = w.pack(pairs=pairs)
            for dtype in (torch.float32, torch.bfloat16):
                got = ql.lookup_rows(part.fmt, part.packed, k, ids, dtype, pairs)
                assert got.dtype == dtype and torch.equal(got, ref[ids].to(dtype))
            if ql._module() is not None:
                with pytest.raises(RuntimeError, match="outside the packed rows"):
                    ql.lookup_rows(
                        part.fmt, part.packed, k, torch.tensor([10**6]), torch.float32, pairs
                    )


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.to(x.dtype).double().T
    return y if bias is None else y + bias.to(x.dtype).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_matches_float64_matmul(qtype, dtype):
    _kernel_or_skip(dtype)
    # relative to |x| @ |W|^T, the scale of a dot product's rounding error; bf16 rounds its output
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, (n, k) in enumerate(SHAPES):
        w = random_weight(qtype, n, k, seed=i)
        ref_w = w.dequantize()
        bias = torch.randn(n) if i % 2 else None
        lin = ql.QuantLinear(
            [w.pack(None if bias is None else ql.pad_bias(bias.to(dtype)))], dtype, CPU
        )
        for m in (1, 5, ql.DENSE_MIN_ROWS.get(dtype, 16) + 3):
            # a strided x: rows of a wider buffer
            x = torch.randn(m, k + 16).to(dtype)[:, 3 : 3 + k]
            y = lin(x)
            ref = _reference(x, ref_w, bias)
            scale = _reference(x.abs(), ref_w.abs(), None if bias is None else bias.abs())
            assert ((y.double() - ref).abs() / scale).max().item() < tol, (n, k, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [512, 288])  # 288: the last 64-wide K slice is half full
def test_rows_are_independent_and_match_the_dense_kernel(qtype, dtype, k, isa):
    """Every M gives a row the same bits. fp32 (and bf16 on AMX) equals the dense kernel on the
    dequantized weights bit for bit; bf16's block-sum form (and the avx2/portable builds, which
    widen bf16 x to fp32) never rounds a weight to bf16, so it must come out at least as close to
    the float64 result as the dense bf16 kernel does."""
    _kernel_or_skip(dtype)
    probe = torch.zeros(48, 64, dtype=dtype)
    if not linear_kernel_supported(probe):
        pytest.skip("dense kernel not built here")
    if k % 256 and qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        pytest.skip("K-quants come in 256-wide super-blocks")
    n = 100
    w = random_weight(qtype, n, k, seed=3)
    lin = ql.QuantLinear([w.pack()], dtype, CPU)
    assert lin.parts[0].pairs == (dtype == torch.bfloat16 and ql.pairs_layout(dtype, CPU))
    # bf16 weights unrounded: the block-sum form, and the generic (avx2/portable) builds
    block_sum = lin.parts[0].pairs or (dtype == torch.bfloat16 and isa != "avx512")
    dense = PackedLinearWeight(w.dequantize().to(dtype))
    x = torch.randn(70, k).to(dtype)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])])
    edge = ql.DENSE_MIN_ROWS.get(dtype, 16)
    for m in (1, 4, 8, 9, 16, edge - 1, edge, 40, 64, 70):
        y = lin(x[:m])
        assert torch.equal(y, alone[:m]), f"a row depends on its batch at M={m}"
        if not block_sum:
            assert torch.equal(y, dense(x[:m])), f"differs from the dense kernel at M={m}"
    if block_sum:
        ref = x.double() @ w.dequantize().double().T  # the weights unrounded
        ours = (alone.double() - ref).abs().mean().item()
        theirs = (dense(x).double() - ref).abs().mean().item()
        assert ours <= theirs, (ours, theirs)


def test_fused_parts_of_different_types_fill_their_columns():
    """q|k|v stored in different types (Q4_K_M files mix Q4_K and Q6_K): each part lands in its
    own columns of one output (a strided view for the kernel), bias included."""
    dtype = torch.float32
    _kernel_or_skip(dtype)
    k = 256
    ws = [
        random_weight(t, n, k, seed=i)
        for i, (t, n) in enumerate([(T.Q4_K, 50), (T.Q6_K, 20), (T.Q8_0, 33)])
    ]
    gen = torch.Generator().manual_seed(
        5
    )  # unseeded draws made this flaky (it failed 1 of 3 CI runs)
    biases = [torch.randn(w.shape[0], generator=gen) for w in ws]
    lin = ql.QuantLinear(
        [w.pack(ql.pad_bias(b)) for w, b in zip(ws, biases, strict=True)], dtype, CPU
    )
    x = torch.randn(7, k, generator=gen)
    ref = torch.cat(
        [_reference(x, w.dequantize(), b) for w, b in zip(ws, biases, strict=True)], dim=1
    )
    y = lin(x)
    assert y.shape == (7, 103)
    # outputs reach ~20: fp32 sums of 256 products round at ~1e-5 absolute, so 1e-5 was the edge
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_same_type_parts_run_as_one_part_with_the_same_bits(dtype):
    """q|k|v of one type become one part (one kernel call): each column equals that part computed
    on its own, bit for bit. A part that is not a whole number of panels wide ends the run."""
    _kernel_or_skip(dtype)
    k = 256
    spec = [(T.Q4_1, 96), (T.Q4_1, 48), (T.Q4_1, 50), (T.Q4_1, 48), (T.Q8_0, 48)]
    ws = [random_weight(t, n, k, seed=i) for i, (t, n) in enumerate(spec)]
    biases = [torch.randn(w.shape[0]).to(dtype) for w in ws]
    fused = ql.QuantLinear(
        [w.pack(ql.pad_bias(b)) for w, b in zip(ws, biases, strict=True)], dtype, CPU
    )
    assert [p.n for p in fused.parts] == [194, 48, 48]
    x = torch.randn(20, k).to(dtype)
    alone = [
        ql.QuantLinear([w.pack(ql.pad_bias(b))], dtype, CPU)
        for w, b in zip(ws, biases, strict=True)
    ]
    for m in (1, 5, 20):
        assert torch.equal(fused(x[:m]), torch.cat([lin(x[:m]) for lin in alone], dim=1))


@pytest.mark.parametrize("int8", [False, True])
def test_torch_fallback_matches_kernel_reference(monkeypatch, int8):
    """Without the C++ kernel (another device, a failed build) the layer dequantizes its weights
    once, at construction, never per call."""
    w = random_weight(T.Q4_1, 60, 256, int8=int8)
    # what a failed build leaves
    monkeypatch.setattr(ql, "quant_kernel_supported", lambda *a: False)
    lin = ql.QuantLinear([w.pack()], torch.float32, CPU)
    assert lin._kernel is None and lin._dense is not None
    calls = []
    monkeypatch.setattr(ql, "dequantize_packed", lambda *a: calls.append(a))
    monkeypatch.setattr(ql, "dequantize_int8", lambda *a: calls.append(a))
    x = torch.randn(3, 256)
    assert torch.allclose(
        lin(x).double(), _reference(x, w.dequantize(), None), rtol=1e-5, atol=1e-5
    )
    assert calls == []


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_large_batches_cover_every_panel_group_and_row_block(qtype):
    """bf16 calls past one row block (96 rows) walk each thread's panels a group at a time
    (kPanelGroupBytes, quant_blocksum.h). K = 4096 makes a Q4_1 panel 120 KiB, so 11 panels
    form several groups, and 200 rows three row blocks (the last one partial). Every output must
    be written, and equal to the row computed alone."""
    _kernel_or_skip(torch.bfloat16)
    n, k, m = 48 * 10 + 5, 4096, 200
    w = random_weight(qtype, n, k, seed=5)
    lin = ql.QuantLinear([w.pack()], torch.bfloat16, CPU)
    x = torch.randn(m, k).to(torch.bfloat16)
    y = lin(x)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(m)])
    assert torch.equal(y, alone)
    ref = _reference(x, w.dequantize(), None)
    scale = _reference(x.abs(), w.dequantize().abs(), None)
    assert ((y.double() - ref).abs() / scale).max().item() < 1e-2
