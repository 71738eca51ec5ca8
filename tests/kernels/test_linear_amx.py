"""The bf16 AMX tiles (linear_amx.h) run two 16-row groups per pass over a panel when M > 16, and
one group for a lone last group (and for M <= 16). Every row must come out bit for bit as the
same row computed alone (M = 1: one group, one tile row), whichever pass, row block (96 rows) or
thread computed it: K tails (K % 32), partial panels (N % 48), bias and padding rows included."""

from __future__ import annotations

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


def _require_amx() -> None:
    if not linear_kernel_supported(torch.zeros(48, 64, dtype=torch.bfloat16)):
        pytest.skip("no bf16 linear kernel in this build")
    if not linear_kernel_uses_amx():
        pytest.skip("bf16 does not run on AMX here (no AMX, or TESSERA_DISABLE_AMX is set)")


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
def test_two_group_pass_rows_equal_rows_alone(n, k, bias):
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
