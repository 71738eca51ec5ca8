"""Both attention backends against a naive reference (per-token causal attention over the sequence's
unpaged K/V, fp32), on one flat batch mixing decodes, fresh prefills and continuing chunks, with
random block tables, GQA and no GQA, fp32 and bf16; the backends against each other; and the choice
of backend."""

from __future__ import annotations

import random

import pytest
import torch

from tessera.attention import SeqSpan, select_attention_backend
from tessera.attention.paged_kernel import PagedKernelBackend, PagedKernelMetadata
from tessera.attention.sdpa import SdpaBackend, SdpaMetadata
from tessera.kernels.paged_attention import paged_attention_available

CPU = torch.device("cpu")
HAVE_KERNEL = paged_attention_available(CPU, torch.float32)
BACKENDS = [
    "sdpa",
    pytest.param(
        "paged_kernel",
        marks=pytest.mark.skipif(not HAVE_KERNEL, reason="C++ paged-attention kernel not built"),
    ),
]
HEADS = [(6, 2), (4, 4)]  # (num_heads, num_kv_heads): GQA group 3, and none
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_step(seed, block_size, num_heads, num_kv_heads, dtype, head_dim=16, decodes_only=False):
    """A step in the runner's order: 4 decodes, then a fresh prefill, a continuing chunk (context
    ending mid-block), a continuing chunk starting on a block boundary, a one-token fresh prompt
    (`decodes_only`: the decodes alone, a step of one token a sequence). The context is already
    in the cache; the new tokens' K/V arrive with the batch."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # (num_computed_tokens, num_new_tokens)
    shapes = [(rng.randint(1, 70), 1) for _ in range(4)]
    if not decodes_only:
        shapes += [(0, rng.randint(2, 40)), (rng.randint(1, 50), rng.randint(2, 30))]
        shapes += [(2 * block_size, rng.randint(2, 20)), (0, 1)]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 3
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)

    spans, full_k, full_v, positions, slot_mapping = [], [], [], [], []
    row = 0
    for num_context, num_new in shapes:
        length = num_context + num_new
        table = [free.pop() for _ in range(-(-length // block_size))]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        kf = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        vf = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        flat_k[slots[:num_context]] = kf[:num_context]
        flat_v[slots[:num_context]] = vf[:num_context]
        spans.append(SeqSpan(row, num_new, num_context, table))
        full_k.append(kf)
        full_v.append(vf)
        positions.extend(range(num_context, length))
        slot_mapping.extend(slots[num_context:])
        row += num_new
    q = torch.randn(row, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.cat([kf[s.num_computed_tokens :] for s, kf in zip(spans, full_k, strict=True)])
    v = torch.cat([vf[s.num_computed_tokens :] for s, vf in zip(spans, full_v, strict=True)])
    return dict(
        q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, spans=spans, full_k=full_k, full_v=full_v,
        positions=positions, slot_mapping=torch.tensor(slot_mapping), scale=head_dim**-0.5,
    )  # fmt: skip


def reference(step) -> torch.Tensor:
    """Per token, in fp32: softmax(q k^T * scale) v over positions [0, position] of its sequence."""
    q, scale = step["q"].float(), step["scale"]
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    for span, kf, vf in zip(step["spans"], step["full_k"], step["full_v"], strict=True):
        group = num_heads // kf.shape[1]
        for i in range(span.num_new_tokens):
            row, pos = span.query_start + i, span.num_computed_tokens + i
            for h in range(num_heads):
                keys = kf[: pos + 1, h // group].float()  # [pos + 1, D]
                probs = (keys @ q[row, h] * scale).softmax(0)
                out[row, h] = probs @ vf[: pos + 1, h // group].float()
    return out


def run_backend(name, step, block_size):
    backend = select_attention_backend(CPU, step["q"].dtype, block_size, name=name)
    meta = backend.build_metadata(step["spans"], step["slot_mapping"], step["positions"])
    out = meta.forward(
        step["q"], step["k"], step["v"], step["k_cache"], step["v_cache"], step["scale"]
    )
    return meta, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=[f"h{h}kv{k}" for h, k in HEADS])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_reference(name, block_size, heads, dtype):
    step = make_step(block_size + heads[0], block_size, *heads, dtype)
    meta, out = run_backend(name, step, block_size)
    assert isinstance(meta, PagedKernelMetadata if name == "paged_kernel" else SdpaMetadata)
    assert out.dtype == dtype and out.shape == step["q"].shape
    torch.testing.assert_close(out.float(), reference(step), atol=TOL[dtype], rtol=0)
    # forward wrote the new K/V at their slots
    slots = step["slot_mapping"]
    flat_k = step["k_cache"].view(-1, *step["k"].shape[1:])
    flat_v = step["v_cache"].view(-1, *step["v"].shape[1:])
    assert torch.equal(flat_k[slots], step["k"]) and torch.equal(flat_v[slots], step["v"])


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("name", BACKENDS)
def test_decode_only_step_matches_reference(name, block_size):
    """One token a sequence (the paged backend takes each sequence's table as its row's)."""
    step = make_step(3 + block_size, block_size, 6, 2, torch.float32, decodes_only=True)
    _, out = run_backend(name, step, block_size)
    torch.testing.assert_close(out, reference(step), atol=TOL[torch.float32], rtol=0)


@pytest.mark.skipif(not HAVE_KERNEL, reason="C++ paged-attention kernel not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backends_agree(dtype):
    outs = [
        run_backend(name, make_step(7, 16, 6, 2, dtype), 16)[1] for name in ("sdpa", "paged_kernel")
    ]
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("name", BACKENDS)
def test_decode_after_prompt_chunk_is_rejected(name):
    """The ordering contract: decodes first. The SDPA backend relies on it (decodes are one
    slice)."""
    step = make_step(0, 16, 6, 2, torch.float32)
    spans = step["spans"]
    decode, chunk = spans[3], spans[4]  # the last decode and the fresh prefill after it
    swapped = [
        SeqSpan(decode.query_start, chunk.num_new_tokens, 0, chunk.block_table),
        SeqSpan(
            decode.query_start + chunk.num_new_tokens,
            1,
            decode.num_computed_tokens,
            decode.block_table,
        ),
    ]
    backend = select_attention_backend(CPU, torch.float32, 16, name=name)
    with pytest.raises(AssertionError, match="decode span 4 after a prompt chunk"):
        backend.build_metadata(
            spans[:3] + swapped + spans[5:], step["slot_mapping"], step["positions"]
        )


def test_select_attention_backend():
    auto = select_attention_backend(CPU, torch.float32, 16)
    assert isinstance(auto, PagedKernelBackend if HAVE_KERNEL else SdpaBackend)
    assert auto.block_size == 16 and auto.device == CPU
    # the kernel serves float32/bfloat16 on the CPU only; CUDA (not touched here) gets SDPA
    assert isinstance(select_attention_backend(CPU, torch.float16, 16), SdpaBackend)
    cuda = torch.device("cuda")
    assert isinstance(select_attention_backend(cuda, torch.bfloat16, 16), SdpaBackend)
    assert isinstance(select_attention_backend(CPU, torch.float32, 16, name="sdpa"), SdpaBackend)
    with pytest.raises(ValueError, match="does not serve cuda"):
        select_attention_backend(cuda, torch.bfloat16, 16, name="paged_kernel")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_attention_backend(CPU, torch.float32, 16, name="flash")
