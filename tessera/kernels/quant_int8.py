"""The weight layout of the integer path (`--quantization gguf_int8`, quant_int8.h): packing from
the canonical codes/scales/mins of tessera/model/gguf_quant.py, and decoding in torch.

Row-major: output row n is K/32 records in K order (no panels: the integer kernel computes one
output a dot product, llama.cpp's way, and rows of several parts concatenate as they are).

| kind | record | GGUF types | bits a weight |
| --- | --- | --- | ---: |
| u4h | f16 d, f16 m, 16 B nibbles | Q4_0 (m = -8 d), Q4_1 | 5 |
| u4f | f32 d, f32 m, 16 B nibbles | Q4_K | 6 |
| u8f | f32 d, f32 m, 32 B codes 0..31 | Q5_K | 10 |
| s8h | f16 d, 32 int8 | Q8_0 | 8.5 |
| s8f2 | f32 d per 16 (two), 32 int8 (q - 32) | Q6_K | 10 |

Nibbles as GGML stores them: byte j holds k = j (low) and k = j + 16 (high). The values are
gguf's (code * d + m), so `dequantize_int8` equals gguf's dequantization; only the activations
are rounded (to Q8 blocks, in the kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # K positions a record


@dataclass(frozen=True)
class Int8Format:
    """One record layout of the integer kernel; `kernel_id` is its Kind in quant_int8.h."""

    name: str
    kernel_id: int
    scale_dtype: type
    unsigned: bool  # codes >= 0 with a min per block; else signed codes, no min
    nibbles: bool
    groups: int  # scales a block (signed kinds)

    row_major = True  # QuantPart users tell the layouts apart by this (panels: False)
    block = QK

    @property
    def head_bytes(self) -> int:
        item = np.dtype(self.scale_dtype).itemsize
        return item * (2 if self.unsigned else self.groups)

    @property
    def record_bytes(self) -> int:
        return self.head_bytes + (16 if self.nibbles else 32)

    def packed_bytes(self, n: int, k: int) -> int:
        return n * (k // QK) * self.record_bytes


U4H = Int8Format("u4h", 10, np.float16, True, True, 1)
U4F = Int8Format("u4f", 11, np.float32, True, True, 1)
U8F = Int8Format("u8f", 12, np.float32, True, False, 1)
S8H = Int8Format("s8h", 13, np.float16, False, False, 1)
S8F2 = Int8Format("s8f2", 14, np.float32, False, False, 2)


def pack_int8(
    fmt: Int8Format, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None
) -> torch.Tensor:
    """codes [N, K] (unsigned kinds: 0..15 or 0..31; signed: int8), scales [N, K / 32 * groups]
    (or [N, K / 16] for two groups), mins [N, K / 32] (unsigned kinds) -> uint8 records."""
    n, k = codes.shape
    if k % QK:
        raise ValueError(f"K ({k}) is not a multiple of {QK}")
    nb = k // QK
    c = np.ascontiguousarray(codes).view(np.uint8).reshape(n, nb, QK)
    if fmt.nibbles:
        c = c[..., :16] | (c[..., 16:] << np.uint8(4))
    heads = [np.ascontiguousarray(scales, dtype=fmt.scale_dtype).reshape(n, nb, -1)]
    if fmt.unsigned:
        assert mins is not None
        heads.append(np.ascontiguousarray(mins, dtype=fmt.scale_dtype).reshape(n, nb, 1))
    head = np.concatenate(heads, axis=-1).view(np.uint8)
    records = np.concatenate([head, c], axis=-1)
    assert records.shape[-1] == fmt.record_bytes
    return torch.from_numpy(np.ascontiguousarray(records).reshape(-1))


def _decode(fmt: Int8Format, records: torch.Tensor) -> torch.Tensor:
    """records [..., record_bytes] -> float32 weights [..., 32] (gguf's values)."""
    head = records[..., : fmt.head_bytes].contiguous()
    tdtype = torch.float16 if fmt.scale_dtype is np.float16 else torch.float32
    tables = head.view(tdtype).float()  # [..., 2] (d, m) or [..., groups]
    raw = records[..., fmt.head_bytes :]
    if fmt.nibbles:
        q = torch.cat([raw & 15, raw >> 4], dim=-1).float()
    elif fmt.unsigned:
        q = raw.float()
    else:
        q = raw.view(torch.int8).float()
    if fmt.unsigned:
        return q * tables[..., :1] + tables[..., 1:2]
    return q * tables.repeat_interleave(QK // fmt.groups, dim=-1)


def dequantize_int8(fmt: Int8Format, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The float32 weights [N, K] a packed tensor holds."""
    return _decode(fmt, packed.view(n, k // QK, fmt.record_bytes)).reshape(n, k)


def dequantize_int8_rows(
    fmt: Int8Format, packed: torch.Tensor, k: int, ids: torch.Tensor
) -> torch.Tensor:
    """Float32 rows `ids` [T] -> [T, K]: the embedding lookup reads only those rows' records."""
    rows = packed.view(-1, k // QK, fmt.record_bytes)[ids.reshape(-1)]
    return _decode(fmt, rows).reshape(-1, k)
