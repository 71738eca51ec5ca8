"""The bf16 AMX tiles (linear_amx.h): every row of an M-row call must come out bit for bit as the
same row computed alone (M = 1: one row group, one tile row), whichever row group, row block
(kAmxRowsPerBlock = 384 rows, run row-block-major) or thread computed it: K tails (K % 32),
partial panels (N % 48), bias and padding rows included. The GGUF path (quant_linear.cpp's
run_amx) must equal the dense kernel on the dequantized weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tessera.kernels.linear import (
    PackedLinearWeight,
    linear_kernel_supported,
    linear_kernel_uses_amx,
)

ROWS = (1, 15, 16, 17, 31, 32, 33, 48, 64, 100, 257)
# (N, K): the default model's qkv and down shapes; K % 32 != 0 (tails of 2 and 30); N % 48 != 0
SHAPES = [(960, 576), (100, 1536), (150, 98), (49, 126), (200, 64)]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _require_amx() -> None:
    if not linear_kernel_supported(torch.zeros(48, 64, dtype=torch.bfloat16)):
        if os.environ.get("TESSERA_DISABLE_CPP_KERNELS"):
            pytest.skip("TESSERA_DISABLE_CPP_KERNELS is set")
        if "amx_bf16" in _cpuinfo():
            pytest.fail("linear C++ kernel did not build on this AMX CPU (see the warning log)")
        pytest.skip("no bf16 linear kernel in this build")
    if not linear_kernel_uses_amx():
        pytest.skip("bf16 does not run on AMX here (no AMX, or TESSERA_DISABLE_AMX is set)")


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
def test_rows_equal_rows_alone_at_every_m(n, k, bias):
    _require_amx()
    gen = torch.Generator().manual_seed(n * 31 + k)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    packed = PackedLinearWeight(w, b)
    x = torch.randn(max(ROWS), k, generator=gen).to(torch.bfloat16)
    alone = torch.cat([packed(x[i : i + 1]) for i in range(x.shape[0])])
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert ((alone.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    for m in ROWS:
        got = packed(x[:m])
        bad = (got != alone[:m]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"M={m}: rows {bad[:8]} differ from the rows computed alone"
    # a window that starts mid-group: every row lands in another group, pass and row block
    assert torch.equal(packed(x[5:150]), alone[5:150])


# past kAmxRowsPerBlock (384, linear_amx.h): three row blocks of 288 rows (the last one partial,
# ending in a partial row group), run row-block-major over the panels
MANY_ROWS = 2 * 384 + 50


def test_row_blocks_past_384_rows_equal_rows_alone():
    _require_amx()
    gen = torch.Generator().manual_seed(11)
    n, k = 150, 98
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    packed = PackedLinearWeight(w, b)
    x = torch.randn(MANY_ROWS, k, generator=gen).to(torch.bfloat16)
    alone = torch.cat([packed(x[i : i + 1]) for i in range(MANY_ROWS)])
    got = packed(x)
    bad = (got != alone).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:8]} differ from the rows computed alone"
    assert torch.equal(packed(x[:400]), alone[:400])


def test_quantized_row_blocks_equal_the_dense_kernel():
    """quant_linear.cpp's run_amx dequantizes each (row block, panel) unit's panel exactly into
    bf16 and runs the same tiles: bit for bit the dense kernel on the dequantized weights, at M
    below and past one row block."""
    gguf = pytest.importorskip("gguf")
    from quant_weights import random_weight

    from tessera.kernels import quant_linear as ql

    _require_amx()
    cpu = torch.device("cpu")
    if not ql.quant_kernel_supported(torch.bfloat16, cpu):
        pytest.fail("quantized kernel for bfloat16 did not build on this AMX CPU")
    w = random_weight(gguf.GGMLQuantizationType.Q4_1, 100, 256, seed=7)
    lin = ql.QuantLinear([w.pack()], torch.bfloat16, cpu)
    dense = PackedLinearWeight(w.dequantize().to(torch.bfloat16))
    x = torch.randn(MANY_ROWS, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for m in (1, 16, 17, 100, MANY_ROWS):
        assert torch.equal(lin(x[:m]), dense(x[:m])), f"M={m}"
    last = range(MANY_ROWS - 3, MANY_ROWS)
    assert torch.equal(lin(x)[-3:], torch.cat([lin(x[i : i + 1]) for i in last]))
