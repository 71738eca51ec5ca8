"""The weight layout of the integer path (`--quantization gguf_int8`, quant_int8.h): packing from
the canonical codes/scales/mins of tessera/model/gguf_quant.py, and decoding in torch.

Records of 32 K positions, in K order, in groups of 8 output rows (`Int8Format.interleave`): one
record of a group holds the 8 rows' scales side by side, then their codes so that one 32-byte
load holds 4 consecutive K positions of each of the 8 rows. The kernel then computes 8 outputs
at once, one output a 32-bit lane (vpdpbusd / vpmaddubsw against 4 bytes of x broadcast): the
block's integer sum comes out exact for the 8 rows together (s8f2: one sum a half of 16), and
scales apply once a block as a vector (llama.cpp's repacked Q4_0x8 does the same). Row by row it
took ~22 instructions a block of one row.

| kind | record of one row | GGUF types | bits a weight | rows a group |
| --- | --- | ---: | ---: | ---: |
| q4h | f16 d, 16 B nibbles (m = -8 d, computed) | Q4_0 | 4.5 | 8 |
| u4h | f16 d, f16 m, 16 B nibbles | Q4_1 | 5 | 8 |
| k4s | u8 sc, u8 m, 16 B nibbles; f16 d, dmin a super-block of 256 | Q4_K | 4.625 | 8 |
| k5s | k4s and 4 B of the codes' 5th bits | Q5_K | 5.625 | 8 |
| u8f | f32 d, f32 m, 32 B codes 0..31 | Q5_1 | 10 | 8 |
| s8h | f16 d, 32 int8 | Q8_0 | 8.5 | 8 |
| s8f2 | f32 d per 16 (two), 32 int8 (q - 32) | Q6_K | 10 | 8 |

Nibbles of a row as GGML stores them: byte j holds k = j (low) and k = j + 16 (high). An
interleaved record of a group of 8 rows (r = 0..7) is those rows' records rearranged:

    d[r] for r = 0..7 | m[r] (unsigned kinds but q4h) or d1[r] (s8f2) for r = 0..7 | chunks
    of 32 B: chunk t, byte 4 r + i = row r's code byte 4 t + i (q4h/u4h/k4s: 4 chunks of nibble
    bytes, k = j low and k = j + 16 high; u8f/s8h/s8f2: 8 chunks, byte j is k = j)

k4s keeps Q4_K's own factors (a row's values are d sc q - dmin m, sc and m 6-bit a block of 32,
d and dmin f16 a super-block of 256): a row's unit of 256 K positions is d | dmin | sc[8] | m[8]
| 8 blocks of 16 nibble bytes (148 B), and a group's 8 block records of a super-block hold, each,
sc[8 rows] | m[8 rows] | 4 bytes of the 8 rows' d (records 0-3: rows 2j, 2j + 1) or dmin (records
4-7) | its 4 chunks (`_super_order`). k5s (Q5_K) has 4 bytes more in a row's block: its codes'
5th bits, byte i bit t for K position 4 t + i; in the group record, a 32-byte plane after the
factors (byte 4 r + i, bit t: row r's), before the chunks of the low nibbles.

A weight whose rows are not a multiple of 8 is padded with zero rows (d = m = 0). The values are
gguf's (code * d + m), so `dequantize_int8` equals gguf's dequantization; only the activations
are rounded (to Q8 blocks, in the kernel).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # K positions a record
SUPER = 8  # k4s, k5s: blocks a super-block


@dataclass(frozen=True)
class Int8Format:
    """One record layout of the integer kernel; `kernel_id` is its Kind in quant_int8.h."""

    name: str
    kernel_id: int
    scale_dtype: type
    unsigned: bool  # codes >= 0 with a min per block; else signed codes, no min
    nibbles: bool
    groups: int  # scales a block (signed kinds)
    interleave: int = 8  # output rows a group of records
    offset_min: bool = False  # unsigned codes whose min is -8 d (Q4_0): computed, not stored
    super_block: bool = False  # 6-bit scales and mins times f16 factors of 256 (Q4_K, Q5_K)
    high_bits: bool = False  # nibbles and a plane of 5th bits (Q5_K)

    row_major = True  # the integer path's layout, not panels (QuantPart users tell them apart)
    block = QK

    @property
    def unit(self) -> int:
        """K positions of a row's record (`record_bytes`): a block, or a k4s/k5s super-block."""
        return QK * SUPER if self.super_block else QK

    @property
    def head_bytes(self) -> int:
        if self.super_block:  # d, dmin (f16), sc[8], m[8], 5th bits (4 B a block)
            return 4 + 2 * SUPER + (4 * SUPER if self.high_bits else 0)
        item = np.dtype(self.scale_dtype).itemsize
        return item * (2 if self.stores_min else self.groups)

    @property
    def stores_min(self) -> bool:
        return self.unsigned and not self.offset_min

    @property
    def record_bytes(self) -> int:
        return self.head_bytes + (16 if self.nibbles else 32) * (self.unit // QK)

    def padded_rows(self, n: int) -> int:
        """Rows the packed tensor holds: n rounded up to whole groups."""
        return -(-n // self.interleave) * self.interleave

    def packed_bytes(self, n: int, k: int) -> int:
        return self.padded_rows(n) * (k // self.unit) * self.record_bytes


U4H = Int8Format("u4h", 10, np.float16, True, True, 1)
Q4H = Int8Format("q4h", 15, np.float16, True, True, 1, offset_min=True)
K4S = Int8Format("k4s", 16, np.uint8, True, True, 1, super_block=True)
K5S = Int8Format("k5s", 17, np.uint8, True, True, 1, super_block=True, high_bits=True)
U8F = Int8Format("u8f", 12, np.float32, True, False, 1)
S8H = Int8Format("s8h", 13, np.float16, False, False, 1)
S8F2 = Int8Format("s8f2", 14, np.float32, False, False, 2)


def pack_int8(
    fmt: Int8Format, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None
) -> torch.Tensor:
    """codes [N, K] (unsigned kinds: 0..15 or 0..31; signed: int8), scales [N, K / 32 * groups]
    (or [N, K / 16] for two groups), mins [N, K / 32] (unsigned kinds; for q4h they must be
    -8 scales, which the kernel computes) -> uint8 records."""
    n, k = codes.shape
    if k % QK:
        raise ValueError(f"K ({k}) is not a multiple of {QK}")
    nb = k // QK
    c = np.ascontiguousarray(codes).view(np.uint8).reshape(n, nb, QK)
    if fmt.nibbles:
        c = c[..., :16] | (c[..., 16:] << np.uint8(4))
    heads = [np.ascontiguousarray(scales, dtype=fmt.scale_dtype).reshape(n, nb, -1)]
    if fmt.offset_min:
        assert mins is not None and np.array_equal(
            np.asarray(mins, np.float32), np.asarray(scales, np.float32) * np.float32(-8)
        ), "q4h's mins are -8 d"
    elif fmt.unsigned:
        assert mins is not None
        heads.append(np.ascontiguousarray(mins, dtype=fmt.scale_dtype).reshape(n, nb, 1))
    head = np.concatenate(heads, axis=-1).view(np.uint8)
    records = np.concatenate([head, c], axis=-1)
    assert records.shape[-1] == fmt.record_bytes
    rows = torch.from_numpy(np.ascontiguousarray(records))  # [N, nb, record]
    return _interleave(fmt, rows).reshape(-1)


def pack_super(fmt: Int8Format, codes: np.ndarray, d: np.ndarray, dmin: np.ndarray,
               sc: np.ndarray, m: np.ndarray) -> torch.Tensor:
    """Q4_K's or Q5_K's factors -> k4s or k5s records: codes [N, K] (0..15, or 0..31 for k5s),
    d and dmin [N, K / 256] (f16 values), sc and m [N, K / 32] 0..63."""
    n, k = codes.shape
    if k % (QK * SUPER):
        raise ValueError(f"K ({k}) is not a multiple of {QK * SUPER}")
    ns = k // (QK * SUPER)
    c = np.ascontiguousarray(codes).astype(np.uint8).reshape(n, ns, SUPER, QK)
    low = c & np.uint8(15)
    nibbles = (low[..., :16] | (low[..., 16:] << np.uint8(4))).reshape(n, ns, -1)
    factors = np.stack([d, dmin], axis=-1).astype(np.float16).view(np.uint8).reshape(n, ns, 4)
    parts = [factors] + [np.asarray(v, dtype=np.uint8).reshape(n, ns, SUPER) for v in (sc, m)]
    if fmt.high_bits:  # byte i, bit t: the 5th bit of K position 4 t + i, 4 bytes a block
        fifth = (c >> np.uint8(4)).reshape(n, ns, SUPER, 8, 4)
        weights = (np.uint8(1) << np.arange(8, dtype=np.uint8))[:, None]
        parts.append((fifth * weights).sum(axis=-2, dtype=np.uint8).reshape(n, ns, -1))
    units = np.concatenate([*parts, nibbles], axis=-1)
    assert units.shape[-1] == fmt.record_bytes
    return _interleave(fmt, torch.from_numpy(np.ascontiguousarray(units))).reshape(-1)


@functools.cache
def _super_order(fmt: Int8Format) -> torch.Tensor:
    """Byte i of a group's k4s/k5s super-block (its 8 block records) is byte order[i] of its 8
    rows' units side by side ([8 rows x record_bytes])."""
    u = fmt.record_bytes
    src: list[int] = []
    for j in range(SUPER):
        src += [r * u + 4 + j for r in range(8)]  # sc of block j
        src += [r * u + 4 + SUPER + j for r in range(8)]  # m
        which, pair = divmod(j, 4)  # records 0-3: d of rows 2j, 2j + 1; 4-7: dmin
        src += [r * u + 2 * which + i for r in (2 * pair, 2 * pair + 1) for i in range(2)]
        if fmt.high_bits:  # the 5th bits of block j: 4 bytes a row
            src += [r * u + 4 + 2 * SUPER + 4 * j + i for r in range(8) for i in range(4)]
        start = fmt.head_bytes + 16 * j  # block j's nibble bytes
        src += [r * u + start + 4 * t + i for t in range(4) for r in range(8) for i in range(4)]
    return torch.tensor(src)


def _interleave(fmt: Int8Format, rows: torch.Tensor) -> torch.Tensor:
    """Row-major records [N, units, R] -> the packed arrangement of `fmt` ([G, units, 8 R], N
    padded with zero rows)."""
    g = fmt.interleave
    n, nb, r = rows.shape
    pad = fmt.padded_rows(n) - n
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, nb, r)])
    grouped = rows.view(-1, g, nb, r).transpose(1, 2)  # [G, nb, 8, R]
    if fmt.super_block:
        return grouped.reshape(-1, nb, g * r)[..., _super_order(fmt)].contiguous()
    h, s = fmt.head_bytes, np.dtype(fmt.scale_dtype).itemsize
    # scales: [8 rows, scalars, bytes] -> [scalars, 8 rows, bytes] (d[8], then m[8])
    head = grouped[..., :h].reshape(-1, nb, g, h // s, s).transpose(2, 3)
    # codes: [8 rows, chunks, 4 bytes] -> [chunks, 8 rows, 4 bytes]
    codes = grouped[..., h:].reshape(-1, nb, g, (r - h) // 4, 4).transpose(2, 3)
    parts = [head.reshape(-1, nb, g * h), codes.reshape(-1, nb, g * (r - h))]
    return torch.cat(parts, dim=-1).contiguous()


def _rows(fmt: Int8Format, packed: torch.Tensor, nb: int) -> torch.Tensor:
    """The packed bytes -> row-major records [padded rows, nb units, R] (inverse of
    `_interleave`)."""
    r = fmt.record_bytes
    g = fmt.interleave
    grouped = packed.view(-1, nb, g * r)
    if fmt.super_block:
        rows = torch.empty_like(grouped)
        rows[..., _super_order(fmt)] = grouped
        rows = rows.view(-1, nb, g, r)
    else:
        h, s = fmt.head_bytes, np.dtype(fmt.scale_dtype).itemsize
        head = grouped[..., : g * h].reshape(-1, nb, h // s, g, s).transpose(2, 3)
        codes = grouped[..., g * h :].reshape(-1, nb, (r - h) // 4, g, 4).transpose(2, 3)
        rows = torch.cat([head.reshape(-1, nb, g, h), codes.reshape(-1, nb, g, r - h)], dim=-1)
    return rows.transpose(1, 2).reshape(-1, nb, r)  # [G, nb, 8, R] -> [N, nb, R]


def concat_int8(fmt: Int8Format, packed: list[torch.Tensor], ns: list[int], k: int) -> torch.Tensor:
    """Several packed weights of one kind stacked along the output rows, as one packed weight
    (each one's padding rows dropped first, so the rows stay contiguous)."""
    nb = k // fmt.unit
    rows = torch.cat([_rows(fmt, p, nb)[:n] for p, n in zip(packed, ns, strict=True)])
    return _interleave(fmt, rows).reshape(-1)


def _decode_super(fmt: Int8Format, units: torch.Tensor) -> torch.Tensor:
    """k4s/k5s units [..., record_bytes] -> float32 weights [..., 256]: d sc q - dmin m, as gguf
    rounds it (d sc and dmin m are exact)."""
    factors = units[..., :4].contiguous().view(torch.float16).float()  # [..., 2]
    sc = units[..., 4 : 4 + SUPER].float()
    m = units[..., 4 + SUPER : 4 + 2 * SUPER].float()
    raw = units[..., fmt.head_bytes :].reshape(*units.shape[:-1], SUPER, 16)
    q = torch.cat([raw & 15, raw >> 4], dim=-1)  # [..., 8, 32]
    if fmt.high_bits:
        fifth = units[..., 4 + 2 * SUPER : fmt.head_bytes].reshape(*units.shape[:-1], SUPER, 1, 4)
        shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
        q = q | (((fifth >> shifts) & 1) << 4).reshape(q.shape)  # [.., 8 blocks, 8 t, 4 i]
    q = q.float()
    scale = (factors[..., :1] * sc).unsqueeze(-1)
    mins = (-(factors[..., 1:2] * m)).unsqueeze(-1)
    return (q * scale + mins).flatten(-2)


def _decode(fmt: Int8Format, records: torch.Tensor) -> torch.Tensor:
    """records [..., record_bytes] -> float32 weights [..., unit] (gguf's values)."""
    if fmt.super_block:
        return _decode_super(fmt, records)
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
    if fmt.offset_min:
        return q * tables[..., :1] + tables[..., :1] * -8.0
    if fmt.unsigned:
        return q * tables[..., :1] + tables[..., 1:2]
    return q * tables.repeat_interleave(QK // fmt.groups, dim=-1)


def dequantize_int8(fmt: Int8Format, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The float32 weights [N, K] a packed tensor holds."""
    return _decode(fmt, _rows(fmt, packed, k // fmt.unit)[:n]).reshape(n, k)


def dequantize_int8_rows(
    fmt: Int8Format, packed: torch.Tensor, k: int, ids: torch.Tensor
) -> torch.Tensor:
    """Float32 rows `ids` [T] -> [T, K]: the embedding lookup reads only those rows' records
    (their groups' records, for the interleaved kinds)."""
    ids = ids.reshape(-1)
    g, nb = fmt.interleave, k // fmt.unit
    groups = packed.view(-1, nb * g * fmt.record_bytes)[ids // g]  # [T, group bytes]
    rows = _rows(fmt, groups.reshape(-1), nb).view(-1, g, nb, fmt.record_bytes)
    picked = rows[torch.arange(ids.numel()), ids % g]  # [T, nb, R]
    return _decode(fmt, picked).reshape(-1, k)
