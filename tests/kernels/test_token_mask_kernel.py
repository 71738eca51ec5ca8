"""The token-bitmask kernel and its torch fallback against xgrammar's own application, on random
masks (including all-allowed and all-masked words), odd vocabularies and a subset of rows."""

from __future__ import annotations

import pytest
import torch

from tessera.kernels import token_mask

xgr = pytest.importorskip("xgrammar")


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    bits[:, ::5] = -1  # all allowed
    bits[:, 1::7] = 0  # all masked
    return bits


@pytest.mark.parametrize("vocab", [49152, 1000, 49159, 33])
@pytest.mark.parametrize("fallback", [False, True])
def test_matches_xgrammar(vocab, fallback, monkeypatch, isa):
    if fallback:
        monkeypatch.setattr(token_mask, "load_extension", lambda *a: None)
    bitmask = random_bitmask(5, vocab, seed=vocab)
    logits = torch.randn(5, vocab)
    rows = [0, 2, 3]
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=rows)
    got = logits.clone()
    token_mask.apply_bitmask_(got, bitmask, rows)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # rows not listed are untouched
    assert torch.isneginf(got[rows]).any() and torch.isfinite(got[rows]).any()


def test_kernel_is_built_here(isa):
    """On this machine the C++ path must exist; otherwise the fallback above hides its absence."""
    assert token_mask.load_extension("tessera_token_mask", token_mask._SOURCE) is not None
