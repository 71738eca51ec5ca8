"""Paged attention: a C++ CPU kernel that reads K/V blocks in place, with a torch fallback.

One query token per row: a decode, or one token of a prompt chunk, each attending to the first
`seq_lens[b]` tokens of its sequence (for a prompt token, its position + 1: the length is the causal
mask). The kernel (paged_attention.cpp) is compiled just in time (see tessera/kernels/build.py). If
the build fails, or the tensors are not on the CPU, `paged_attention` falls back to the padded
gather + SDPA path (the same math, slower).

Inputs, as the paged-kernel attention backend (tessera/attention/paged_kernel.py) builds them for
every token of a step:
    q             [B, num_heads, head_dim]   last dim contiguous (a slice of the flat batch is fine)
    k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim]  contiguous, float32 or bfloat16
                  (may differ from q's dtype: --kv-cache-dtype; rows are widened to fp32 on load)
    block_tables  [B, max_blocks] int64 or int32, contiguous; entries past a sequence's last used
                  block are never read (any padding value works)
    seq_lens      [B] int64: tokens to attend, the new one included (already written in the cache)
    seq_starts    [B] int64 or None: a sliding window's first visible token of each row (tokens
                  and blocks before it are never read)
GQA: query head h reads kv head h // (num_heads // num_kv_heads) (HF repeat_kv order).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from tessera.kernels.build import load_extension

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_HEADERS = tuple(Path(__file__).with_name(h) for h in (
    "paged_attention_common.h", "paged_attention_avx2.h", "paged_attention_avx512.h",
    "paged_attention_amx.h", "paged_attention_fold.h", "paged_attention_partitions.h",
    "paged_attention_scalar.h", "paged_kv_store.h", "linear_amx.h", "linear_tiles.h"))
_module: ModuleType | None = None


def _load() -> ModuleType | None:
    global _module
    _module = load_extension("tessera_paged_attention", _SOURCE, depends=_HEADERS)
    return _module


_DTYPES = (torch.float32, torch.bfloat16)


def paged_attention_available(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> bool:
    """True when the C++ kernel serves this device, activation dtype and cache dtype (`kv_dtype`,
    default: the activation dtype); builds it on the first call."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if torch.device(device).type != "cpu" or dtype not in _DTYPES or kv_dtype not in _DTYPES:
        return False
    return _load() is not None


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] flat slot = block * block_size + offset
) -> None:
    """Store the new K/V at their flat cache slots, in the cache's dtype (--kv-cache-dtype may
    differ
    from the compute dtype: rounded here, once)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64 or int32
    seq_lens: torch.Tensor,  # [B] int64
    scale: float,
    out: torch.Tensor | None = None,  # [B, num_heads, head_dim]
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    seq_starts: torch.Tensor | None = None,  # [B] int64
) -> torch.Tensor:
    """softmax(q K^T * scale) V for each query row over the first seq_lens[b] tokens of its paged
    context. `new_kv` = (k, v [T, num_kv_heads, head_dim], slot_mapping [T] int64): rows stored
    at their flat cache slots first, in the cache's dtype, by the same call (the kernel saves a
    layer the two index_copy_ of `write_kv`, same values)."""
    if out is None:
        out = torch.empty_like(q)
    if paged_attention_available(q.device, q.dtype, k_cache.dtype):
        assert _module is not None
        k_new, v_new, slots = new_kv if new_kv is not None else (None, None, None)
        return _module.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, float(scale), out, k_new, v_new, slots,
            seq_starts,
        )
    if new_kv is not None:
        write_kv(new_kv[0], new_kv[1], k_cache, v_cache, new_kv[2])
    return _torch_fallback(q, k_cache, v_cache, block_tables, seq_lens, scale, out, seq_starts)


def paged_attention_qkv(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim] q | k | v, RoPE applied
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [T, max_blocks] int64 or int32
    seq_lens: torch.Tensor,  # [T] int64
    scale: float,
    slot_mapping: torch.Tensor,  # [T] int64
    seq_starts: torch.Tensor | None = None,  # [T] int64
) -> torch.Tensor:
    """`paged_attention` on the fused q|k|v projection's output: its k and v stored at
    `slot_mapping`, its q attending; returns [T, num_heads * head_dim], the o-projection's input.
    One kernel call with the head views built in C++ (`qkv_kernel`), else the same values
    through `paged_attention`."""
    kernel = qkv_kernel(qkv.device, qkv.dtype, k_cache.dtype)
    if kernel is not None:
        return kernel(qkv, num_heads, num_kv_heads, k_cache, v_cache, block_tables, seq_lens,
                      float(scale), slot_mapping, seq_starts)
    n, head_dim = qkv.shape[0], k_cache.shape[3]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(n, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(n, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(n, num_kv_heads, head_dim)
    out = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                          new_kv=(k, v, slot_mapping), seq_starts=seq_starts)
    return out.view(n, q_size)


def qkv_kernel(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype
) -> Callable[..., torch.Tensor] | None:
    """The C++ `paged_attention_qkv` when it serves these tensors, else None. A caller that
    attends every layer looks it up once (the lookup asks which build serves this CPU, ~2 us)."""
    if not paged_attention_available(device, dtype, kv_dtype):
        return None
    assert _module is not None
    return _module.paged_attention_qkv


def _torch_fallback(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    seq_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The SDPA backend's decode path (tessera/attention/sdpa.py): gather whole blocks, mask the
    padding, one SDPA."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    blocks = block_tables.reshape(-1).long().clamp(min=0)  # released entries (-1) stay masked
    kd = k_cache.index_select(0, blocks).to(q.dtype)  # a bf16 cache beside fp32 q: widen
    vd = v_cache.index_select(0, blocks).to(q.dtype)
    kd = kd.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    vd = vd.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(kd.shape[2], device=q.device)
    mask = positions.unsqueeze(0) < seq_lens.to(q.device).unsqueeze(1)
    if seq_starts is not None:
        mask &= positions.unsqueeze(0) >= seq_starts.to(q.device).unsqueeze(1)
    mask = mask.view(num_seqs, 1, 1, -1)
    qd = q.reshape(num_seqs, num_kv_heads, group, head_dim)  # [B, kvh, group, D]
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
    out.copy_(od.reshape(num_seqs, num_heads, head_dim))
    return out
