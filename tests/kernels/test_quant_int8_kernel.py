"""The integer path (--quantization gguf_int8; tessera/kernels/quant_int8.*), once per ISA.

The packed records decode to gguf's values bit for bit; the kernel's y equals an emulation of
its own arithmetic (x quantized per row to Q8 blocks, and with two activation planes a residual
plane too; integer block sums, one fp32 scale) to fp32 rounding, so a wrong nibble order, scale,
min or sign is caught, not only a large error; y stays within the rounding of the activations
(8 or 16 bits) of the float64 product; and a row's bits do not depend on its batch.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from quant_weights import random_weight

from tessera.kernels import quant_linear as ql
from tessera.kernels.quant_int8 import QK, dequantize_int8, dequantize_int8_rows
from tessera.model.gguf_quant import QuantizedTensor

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("isa")  # once per instruction set (conftest.py)


def _kernel():
    if not ql.int8_kernel_supported(torch.float32, CPU):
        if os.environ.get("TESSERA_DISABLE_CPP_KERNELS"):
            pytest.skip("TESSERA_DISABLE_CPP_KERNELS is set")
        pytest.fail("quantized kernel did not build for this ISA (see the warning log)")


def _gguf_values(w) -> torch.Tensor:
    n, k = w.shape
    return torch.from_numpy(
        gguf.quants.dequantize(w.data, w.qtype).reshape(n, k).astype(np.float32)
    )


def _emulate(x: torch.Tensor, w, planes: int = 1) -> torch.Tensor:
    """The kernel's arithmetic in float64: x rounded per row to Q8 blocks (d = max|x| / 127,
    ties to even; two planes: plus the residual x - d q rounded to units of d / 254, within
    +-127), then the exact dot product of those values with the weights."""
    xf = x.float().view(x.shape[0], -1, QK)
    d = xf.abs().amax(-1, keepdim=True) / 127  # the kernel's scale is fp32
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xf * inv)  # torch.round: ties to even
    if planes == 1:
        xq = q.double() * d.double()
    else:
        rest = (xf.double() - d.double() * q.double()).float()  # one rounding, as std::fma
        lo = torch.round(rest * (inv * 254)).clamp(-127, 127)
        xq = (254 * q.double() + lo.double()) * (d / 254).double()
    return xq.view(x.shape[0], -1) @ _gguf_values(w).double().T


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_records_decode_to_gguf_values(qtype):
    n, k = 37, 512
    w = random_weight(qtype, n, k, seed=2, int8=True)
    part = w.pack()
    assert part.fmt.row_major and part.packed.numel() == part.fmt.packed_bytes(n, k)
    ref = _gguf_values(w)
    assert torch.equal(dequantize_int8(part.fmt, part.packed, n, k), ref)
    ids = torch.tensor([n - 1, 0, 5, n - 1])
    # the torch decoding (no kernel) and the kernel's lookup (int8_rows_out)
    assert torch.equal(dequantize_int8_rows(part.fmt, part.packed, k, ids), ref[ids])
    for dtype in (torch.float32, torch.bfloat16):
        got = ql.lookup_rows(part.fmt, part.packed, k, ids, dtype)
        assert torch.equal(got, ref[ids].to(dtype))
    if ql.int8_kernel_supported(torch.float32, CPU):
        with pytest.raises(RuntimeError, match="outside the packed rows"):
            ql.lookup_rows(part.fmt, part.packed, k, torch.tensor([part.fmt.padded_rows(n)]),
                           torch.float32)


def _linear(w, dtype, bias: torch.Tensor | None = None, planes: int = 1) -> ql.QuantLinear:
    part = replace(w.pack(None if bias is None else ql.pad_bias(bias.to(dtype))), act_planes=planes)
    return ql.QuantLinear([part], dtype, CPU)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_equals_its_integer_arithmetic(qtype, dtype, planes):
    _kernel()
    n, k = 53, 512
    w = random_weight(qtype, n, k, seed=3, int8=True)
    bias = torch.randn(n)
    lin = _linear(w, dtype, bias, planes)
    x = torch.randn(6, k + 32).to(dtype)[:, 5 : 5 + k]  # strided rows
    x[0, :QK] = 0  # a block of zeros: scale 0
    y = lin(x).double()
    b = bias.to(dtype).double()
    scale = (x.double().abs() @ _gguf_values(w).double().abs().T) + b.abs()
    emulated = _emulate(x, w, planes) + b
    out_tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16 rounds the output once
    assert ((y - emulated).abs() / scale).max().item() < out_tol
    exact = x.double() @ _gguf_values(w).double().T + b
    # each x rounded by at most d / 2 = max|x| / 254 of its block, or by 1 / 254 of that
    tol = 1e-2 if planes == 1 else (1e-4 if dtype == torch.float32 else 8e-3)
    assert ((y - exact).abs() / scale).max().item() < tol


def test_a_residual_plane_holds_x_to_16_bits():
    """Two planes cut the activations' rounding ~250-fold: fp32 results within 2e-5 of the
    float64 product where Q8 blocks alone are ~1e-3 off."""
    _kernel()
    w = random_weight(T.Q4_0, 64, 1024, seed=9, int8=True)
    x = torch.randn(8, 1024)
    exact = x.double() @ _gguf_values(w).double().T
    scale = x.double().abs() @ _gguf_values(w).double().abs().T
    err = {p: ((_linear(w, torch.float32, planes=p)(x).double() - exact).abs() / scale).max()
           for p in (1, 2)}
    assert err[1] > 3e-4 and err[2] < 2e-5 and err[1] > 50 * err[2], err


@pytest.mark.parametrize("planes", [1, 2])
def test_rows_are_quantized_to_the_reference_codes_bit_for_bit(planes):
    """Against Q8_0 identity weights (code 127 on the diagonal), output n of row m is the fp32
    product 127 c * (d_w dx), c = q (or 254 q + lo): the kernel's codes and scales, exactly. The
    reference is the rule in torch: fp32 d = max|x| / 127, q = round(x / d) ties to even, the
    residual rounded once, lo = round(rest * 254 / d) within +-127."""
    _kernel()
    k = 128
    eye = gguf.quants.quantize(np.eye(k, dtype=np.float32), T.Q8_0)
    lin = _linear(QuantizedTensor(T.Q8_0, eye, torch.Size((k, k)), True), torch.float32,
                  planes=planes)
    x = torch.randn(40, k) * torch.logspace(-3, 3, 40).unsqueeze(1)  # 16-row tiles and the rest
    x[3, :QK] = 0  # a block of zeros: scale 0
    x[5, :4] = torch.tensor([0.5, -1.5, 2.5, 127.0])  # ties at q = x / (127 / 127)
    xb = x.view(40, -1, QK)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv)
    if planes == 1:
        c, dx = q, d
    else:
        rest = (xb.double() - d.double() * q.double()).float()  # exact in float64: one rounding
        lo = torch.round(rest * (inv * 254)).clamp(-127, 127)
        c, dx = 254 * q + lo, d / 254
    d_w = float(np.float16(1 / 127))
    expected = ((127 * c).float() * (d_w * dx)).view(40, k)
    assert torch.equal(lin(x), expected)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K],
                         ids=lambda t: t.name)
def test_a_row_does_not_depend_on_its_batch(qtype, dtype, planes):
    """Also across the AMX-INT8 tiles (16 rows and more, where the CPU has them), the
    512-bit loop over pairs of groups (6 rows and more on AVX-512 VNNI without AMX: tiles of 8
    rows, the last one partial) and the group loop (a lone row, the rows after the last 16, an
    odd last group of 8 outputs)."""
    _kernel()
    w = random_weight(qtype, 72, 256, seed=4, int8=True)  # 9 groups of 8: the last one odd
    lin = _linear(w, dtype, torch.randn(72), planes)
    x = torch.randn(40, 256).to(dtype)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(40)])
    for m in (2, 4, 5, 6, 8, 11, 16, 17, 33, 40):
        assert torch.equal(lin(x[:m]), alone[:m]), m


@pytest.mark.parametrize("planes", [1, 2])
def test_a_prefill_row_does_not_depend_on_its_batch(planes):
    """Past 256 rows (prefill) the AMX-INT8 tiles take each 16 rows to a run of expanded
    groups in turn, runs as long as fit in L2 (here more than one a thread): a row alone, in a
    decode-size batch and in the prefill gives the same bits."""
    _kernel()
    n, k = 1048, 2048  # 131 groups of 8 (the last one odd), 32 KiB of B tiles a pair
    w = random_weight(T.Q4_1, n, k, seed=5, int8=True)
    lin = _linear(w, torch.float32, torch.randn(n), planes)
    x = torch.randn(275, k)
    full = lin(x)
    for i in (0, 17, 150, 256, 274):
        assert torch.equal(lin(x[i : i + 1]), full[i : i + 1]), i
    assert torch.equal(lin(x[:40]), full[:40])


def test_amx_int8_tiles_serve_where_the_cpu_has_them(isa):
    """The AVX-512 build runs 16 rows and more on AMX-INT8 where the CPU and kernel allow it
    (TESSERA_DISABLE_AMX turns the tiles off); no other build does."""
    _kernel()
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        flags = []
    disabled = os.environ.get("TESSERA_DISABLE_AMX", "") not in ("", "0")
    usable = isa == "avx512" and {"amx_int8", "amx_bf16", "amx_tile"} <= set(flags)
    assert ql.int8_amx_min_rows() == (16 if usable and not disabled else 0)


def test_parts_of_mixed_types_fill_their_columns_with_their_biases():
    """Row-major parts merge without padding: a 50-row part followed by one of the same type must
    not shift the second part's bias (a panel-padded bias would)."""
    _kernel()
    k = 256
    spec = [(T.Q4_K, 50), (T.Q4_K, 30), (T.Q6_K, 20), (T.Q8_0, 33)]
    ws = [random_weight(t, n, k, seed=i, int8=True) for i, (t, n) in enumerate(spec)]
    gen = torch.Generator().manual_seed(6)
    biases = [torch.randn(w.shape[0], generator=gen) * 10 for w in ws]
    lin = ql.QuantLinear(
        [w.pack(ql.pad_bias(b)) for w, b in zip(ws, biases, strict=True)], torch.float32, CPU
    )
    assert [p.n for p in lin.parts] == [80, 20, 33]  # the two Q4_K parts run as one
    x = torch.randn(3, k, generator=gen)
    ref = torch.cat([_emulate(x, w) + b.double() for w, b in zip(ws, biases, strict=True)], dim=1)
    assert torch.allclose(lin(x).double(), ref, rtol=1e-5, atol=1e-4)


def test_instruction_names_the_isa(isa):
    _kernel()
    expected = {
        "avx512": ("vpdpbusd", "vpmaddubsw"),
        "avx2": ("vpmaddubsw",),
        "portable": ("portable",),
    }
    assert ql.int8_dot_instruction() in expected[isa]
