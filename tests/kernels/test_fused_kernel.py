"""The fused elementwise kernels against float64 references, and the layers' torch fallbacks
against the kernels (the same functions either way)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tessera.kernels.fused import fused_ops_for
from tessera.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rope

pytestmark = pytest.mark.usefixtures("isa")  # once per instruction set (conftest.py)

# relative to the largest reference value: fp32 rounding vs one bf16 rounding of the result
TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3}
CPU = torch.device("cpu")


def _ops(dtype):
    ops = fused_ops_for(CPU, dtype)
    if ops is None:
        if os.environ.get("TESSERA_DISABLE_CPP_KERNELS"):
            pytest.skip("TESSERA_DISABLE_CPP_KERNELS is set")
        pytest.fail("fused C++ kernels did not build for this ISA (see the warning log)")
    return ops


def _close(got: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    rel = (got.double() - ref).abs().max() / ref.abs().max()
    assert rel <= TOL[dtype], rel.item()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 576), (7, 100), (300, 64)])
def test_rms_norm_and_residual_add(dtype, rows, width):
    ops = _ops(dtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    w = torch.randn(width, generator=gen).to(dtype)
    _close(ops.rms_norm(x, w, 1e-5), _rms(x, w, 1e-5), dtype)
    h, d = x.clone(), torch.randn(rows, width, generator=gen).to(dtype)
    total = x.double() + d.double()
    normed = ops.add_rms_norm_(h, d, w, 1e-5)
    _close(h, total, dtype)  # the residual is updated in place
    _close(normed, _rms(total, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_over_the_whole_range(dtype):
    ops = _ops(dtype)
    gate = torch.cat([torch.linspace(-100, 100, 301), torch.tensor([0.0, -1e-30, 88.5, -88.5])])
    up = torch.linspace(-3, 3, gate.numel())
    gu = torch.cat([gate, up]).view(1, -1).to(dtype)
    g, u = gu.double().chunk(2, dim=-1)
    ref = F.silu(g) * u
    got = ops.silu_mul(gu).double()
    assert got.shape == ref.shape
    assert ((got - ref).abs() <= TOL[dtype] * (ref.abs() + 1e-6) + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_only_the_given_heads_in_place(dtype):
    ops = _ops(dtype)
    gen = torch.Generator().manual_seed(3)
    n, heads, rotated, d = 5, 15, 12, 64
    qkv = torch.randn(n, heads * d, generator=gen).to(dtype)
    rope = RotaryEmbedding(d, 64, 10000.0, None, dtype, CPU)
    cos, sin = rope.lookup(torch.tensor([0, 1, 7, 31, 63]))
    ref = apply_rope(
        qkv[:, : rotated * d].double().view(n, rotated, d),
        cos.double()[:, None],
        sin.double()[:, None],
    )
    out = qkv.clone()
    ops.rope_(out, cos, sin, rotated, d)
    _close(out[:, : rotated * d].view(n, rotated, d), ref, dtype)
    assert torch.equal(out[:, rotated * d :], qkv[:, rotated * d :])


def test_layers_fallbacks_agree_with_the_kernels():
    """With the kernel switched off, the layers' torch path computes the same thing."""
    _ops(torch.float32)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 96, generator=gen)
    w = torch.randn(96, generator=gen)
    norm, act = RMSNorm(w, 1e-6), SiluAndMul(CPU, torch.float32)
    rope = RotaryEmbedding(32, 16, 500000.0, None, torch.float32, CPU)
    cos, sin = rope.lookup(torch.arange(9) % 16)
    fast = (norm(x), act(x), x.clone(), x.clone())
    rope.apply_(fast[2], cos, sin, 2)
    normed_fast = norm.add_and_norm(fast[3], x)
    for module in (norm, act, rope):
        module._fused = None
    slow = (norm(x), act(x), x.clone(), x.clone())
    rope.apply_(slow[2], cos, sin, 2)
    normed_slow = norm.add_and_norm(slow[3], x)
    for a, b in zip(fast, slow, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(normed_fast, normed_slow, atol=1e-5)


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (5, 100), (3, 7)])
def test_argmax_lse_against_torch(rows, vocab):
    ops = _ops(torch.float32)
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=gen) * 8
    x[0, vocab // 3] = x[0, vocab - 1] = x[0].max() + 1  # a tie: the first index wins, as torch
    x[-1, : vocab // 2] = float("-inf")  # masked tokens
    idx, lse = ops.argmax_lse(x)
    assert idx.tolist() == x.argmax(-1).tolist()
    ref = x.double().logsumexp(-1)
    assert (lse.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    wide = torch.randn(4, 64, generator=gen).expand(4, 64)[:, :50]  # a row stride past the width
    assert ops.argmax_lse(wide)[0].tolist() == wide.argmax(-1).tolist()
