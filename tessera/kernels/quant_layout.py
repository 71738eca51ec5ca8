"""The packed layout of quantized (GGUF) linear weights, and its decoding in torch.

A weight arrives decoded into a canonical form (tessera/model/gguf_quant.py): integer codes [N, K],
and per block of `block` K-positions a scale (and for the 4-bit formats a min), with

    w[n, k] = code[n, k] * scale[n, k // block] + min[n, k // block]

exactly as gguf's own dequantization computes it. `pack_quantized` lays it out in the kernel's
panels (48 outputs, one record per block, see quant_formats.h) and that packed tensor is the only
copy kept. Four kernel formats cover the five GGUF types:

| format | codes | block | scale, min | GGUF types | bits a weight |
| --- | --- | ---: | --- | --- | ---: |
| q4_half | 4-bit | 32 | fp16, fp16 | Q4_0 (min = -8 d), Q4_1 | 5 |
| q4_float | 4-bit | 32 | fp32, fp32 | Q4_K (d * sc, -dmin * m) | 6 |
| q8_half | int8 | 32 | fp16 | Q8_0 | 8.5 |
| q8_float16 | int8 | 16 | fp32 | Q6_K (q - 32, d * sc) | 10 |

The kernels that stream this layout are in quant_linear.py; this module is only the layout (which
byte holds which code), packing, repacking and merging, and the torch decoding the fallback, the
tests and the embedding's reference use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import torch

from tessera.kernels.quant_int8 import Int8Format, concat_int8

PANEL = 48  # output features per panel: kPanel in linear_tiles.h


@dataclass(frozen=True)
class QuantFormat:
    """One packed layout the kernel streams; `kernel_id` is its FormatId in quant_formats.h."""

    name: str
    kernel_id: int
    bits: int
    block: int
    scale_dtype: type
    has_min: bool

    row_major = False  # panels (quant_int8.Int8Format: the integer path's records, by rows)

    @property
    def code_bytes(self) -> int:
        """Bytes of codes of one record (one block of one panel)."""
        return (self.block // 2 if self.bits == 4 else self.block) * PANEL

    @property
    def scale_itemsize(self) -> int:
        return np.dtype(self.scale_dtype).itemsize

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return torch.float16 if self.scale_dtype is np.float16 else torch.float32

    @property
    def record_bytes(self) -> int:
        return self.code_bytes + PANEL * self.scale_itemsize * (2 if self.has_min else 1)

    def packed_bytes(self, n: int, k: int) -> int:
        return -(-n // PANEL) * (k // self.block) * self.record_bytes


Q4_HALF = QuantFormat("q4_half", 0, 4, 32, np.float16, True)
Q4_FLOAT = QuantFormat("q4_float", 1, 4, 32, np.float32, True)
Q8_HALF = QuantFormat("q8_half", 2, 8, 32, np.float16, False)
Q8_FLOAT16 = QuantFormat("q8_float16", 3, 8, 16, np.float32, False)
# 5-bit codes (0..31) as bytes with a min: Q5_K (d * sc, -dmin * m per 32) and Q5_1
Q8_FLOAT_MIN = QuantFormat("q8_float_min", 4, 8, 32, np.float32, True)


@functools.cache
def code_positions(fmt: QuantFormat, pairs: bool) -> np.ndarray:
    """[block, 48] int64: where code (k, n) of a record lives in its code bytes, as a nibble
    index (4-bit: byte i holds nibbles 2i low, 2i + 1 high) or a byte index (8-bit).

    natural: K position by K position, 48 outputs each, so one 16-byte load gives one K position
      of 16 outputs (4-bit: K 2j low nibble, 2j + 1 high, in one byte).
    pairs: K positions in pairs, each output's two codes side by side, the lane order of
      vdpbf16ps's operand (quant_blocksum.h, code_pairs). 4-bit: 16-bit word 2n + p of the 192
      bytes of group g (8 K positions) holds, in nibble s, the code of K 8g + 2s + p; 8-bit: byte
      (k // 2) * 96 + 2n + k % 2.
    """
    k = np.arange(fmt.block).reshape(-1, 1)
    n = np.arange(PANEL).reshape(1, -1)
    if not pairs:
        return (2 * ((k // 2) * PANEL + n) + k % 2) if fmt.bits == 4 else k * PANEL + n
    if fmt.bits == 8:
        return (k // 2) * 2 * PANEL + 2 * n + k % 2
    g, s, p = k // 8, (k % 8) // 2, k % 2
    return (g * 2 * PANEL + 2 * n + p) * 4 + s


def pack_quantized(
    fmt: QuantFormat, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None,
    pairs: bool = False,
) -> torch.Tensor:
    """codes [N, K] (uint8 0..15 for 4-bit, int8 for 8-bit: 0..31 with a min), scales/mins
    [N, K / block] -> the kernel's panels as one uint8 tensor, codes in the layout `pairs` names
    (code_positions). N is padded to a multiple of 48 with zero weights."""
    n, k = codes.shape
    if k % fmt.block:
        raise ValueError(f"K ({k}) is not a multiple of {fmt.name}'s block size {fmt.block}")
    nb = k // fmt.block
    n_pad = -(-n // PANEL) * PANEL
    padded = np.zeros((n_pad, k), dtype=np.uint8)
    padded[:n] = np.ascontiguousarray(codes).view(np.uint8)
    # [P, nb, block, 48]: record by record, code (k, n) at canonical index k * 48 + n
    canonical = padded.reshape(n_pad // PANEL, PANEL, nb, fmt.block).transpose(0, 2, 3, 1)
    canonical = torch.from_numpy(np.ascontiguousarray(canonical).reshape(n_pad // PANEL, nb, -1))
    parts = [_lay_out_codes(fmt, canonical, pairs)]
    for table in (scales, mins) if fmt.has_min else (scales,):
        assert table is not None
        as_bytes = np.ascontiguousarray(table, dtype=fmt.scale_dtype).view(np.uint8)
        parts.append(torch.from_numpy(_panels(as_bytes.reshape(n, nb, -1), n_pad,
                                              item=fmt.scale_itemsize)))
    packed = torch.cat(parts, dim=2)  # [P, nb, record]
    assert packed.shape[2] == fmt.record_bytes
    return packed.reshape(-1)


def _lay_out_codes(fmt: QuantFormat, canonical: torch.Tensor, pairs: bool) -> torch.Tensor:
    """uint8 codes [..., block * 48] of records, code (k, n) at k * 48 + n -> the records' code
    bytes [..., code_bytes] in the layout `pairs` names."""
    laid = torch.empty_like(canonical)
    laid[..., torch.from_numpy(code_positions(fmt, pairs).reshape(-1))] = canonical
    if fmt.bits == 4:
        laid = laid[..., 0::2] | (laid[..., 1::2] << 4)  # nibble 2i low, 2i + 1 high
    return laid


def with_layout(part: QuantPart, pairs: bool) -> QuantPart:
    """`part` with its codes in the layout `pairs` names: itself when they already are, else a
    repacked copy (the same weights, bit for bit)."""
    if part.pairs == pairs or part.fmt.row_major:  # the integer layout has one code order
        return part
    fmt = part.fmt
    records = part.packed.view(-1, part.k // fmt.block, fmt.record_bytes)
    index, shift = _code_bytes(fmt, part.pairs)
    raw = records[..., index.reshape(-1)]
    canonical = (raw >> shift.reshape(-1).to(torch.uint8)) & 15 if fmt.bits == 4 else raw
    codes = _lay_out_codes(fmt, canonical, pairs)
    packed = torch.cat([codes, records[..., fmt.code_bytes :]], dim=-1).reshape(-1)
    return replace(part, packed=packed, pairs=pairs)


def _panels(rows: np.ndarray, n_pad: int, item: int = 1) -> np.ndarray:
    """[N, nb, L * item] bytes -> [P, nb, L * 48 * item]: per block, L entries of 48 outputs."""
    n, nb, width = rows.shape
    padded = np.zeros((n_pad, nb, width), dtype=np.uint8)
    padded[:n] = rows
    grouped = padded.reshape(n_pad // PANEL, PANEL, nb, width // item, item)
    return grouped.transpose(0, 2, 3, 1, 4).reshape(n_pad // PANEL, nb, -1)


def _code_bytes(fmt: QuantFormat, pairs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[block, 48] the byte of each code (k, n) in a record and its right shift (4-bit: 0 or 4)."""
    pos = torch.from_numpy(code_positions(fmt, pairs))
    if fmt.bits == 4:
        return pos // 2, (pos % 2) * 4
    return pos, torch.zeros_like(pos)


def _extract_codes(fmt: QuantFormat, raw: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Gathered code bytes and their shifts -> float32 codes (4-bit: a nibble, 8-bit: int8)."""
    if fmt.bits == 4:
        return ((raw >> shift.to(torch.uint8)) & 15).float()
    return raw.view(torch.int8).float()


def _tables(fmt: QuantFormat, records: torch.Tensor) -> list[torch.Tensor]:
    """records [..., nb, record_bytes] -> [scales, (mins)], each [..., nb, 48] float32."""
    width = PANEL * fmt.scale_itemsize
    return [
        records[..., fmt.code_bytes + i * width : fmt.code_bytes + (i + 1) * width]
        .contiguous()
        .view(fmt.torch_scale_dtype)
        .float()
        for i in range(2 if fmt.has_min else 1)
    ]


def dequantize_packed(
    fmt: QuantFormat, packed: torch.Tensor, n: int, k: int, pairs: bool = False
) -> torch.Tensor:
    """The float32 weights [N, K] a packed tensor holds (gguf's values, bit for bit)."""
    nb = k // fmt.block
    records = packed.view(-1, nb, fmt.record_bytes)  # [P, nb, record]
    index, shift = _code_bytes(fmt, pairs)
    raw = records[..., index.reshape(-1)].view(*records.shape[:2], fmt.block, PANEL)
    codes = _extract_codes(fmt, raw, shift)  # [P, nb, block, 48]
    tables = _tables(fmt, records)
    w = codes * tables[0].unsqueeze(-2)  # exact: a code times an fp16/fp32 scale fits in fp32
    if fmt.has_min:
        w = w + tables[1].unsqueeze(-2)  # the one rounding, as gguf's q * d + m
    return w.permute(0, 3, 1, 2).reshape(-1, k)[:n]  # [P, 48, nb, block] -> [N, K]


def dequantize_rows(
    fmt: QuantFormat, packed: torch.Tensor, k: int, ids: torch.Tensor, pairs: bool = False
) -> torch.Tensor:
    """Float32 rows `ids` [T] of a packed weight -> [T, K]: an embedding lookup that reads only
    the panels' bytes of those rows (the embedding and a tied lm_head share one packed copy)."""
    nb = k // fmt.block
    records = packed.view(-1, nb, fmt.record_bytes)[ids // PANEL]  # [T, nb, record] (48 rows each)
    # each row's own bytes of its panel first, then decode: 1/48 of the work of decoding the
    # panels (1.1 ms -> see benchmarks/step_profile.py, at 16 ids of the default model)
    lane = ids % PANEL
    index, shift = _code_bytes(fmt, pairs)
    t = ids.numel()
    raw = records.gather(-1, index.t()[lane].unsqueeze(1).expand(t, nb, fmt.block))
    codes = _extract_codes(fmt, raw, shift.t()[lane].unsqueeze(1))  # [T, nb, block]
    scale_bytes = fmt.scale_itemsize
    tables = records[..., fmt.code_bytes :].reshape(t, nb, -1, PANEL, scale_bytes)
    tables = tables.gather(-2, lane.view(-1, 1, 1, 1, 1).expand(t, nb, tables.shape[2], 1,
                                                                 scale_bytes)).squeeze(-2)
    tables = tables.contiguous().view(fmt.torch_scale_dtype).squeeze(-1).float()  # [T, nb, 1 or 2]
    w = codes * tables[..., :1]
    if fmt.has_min:
        w = w + tables[..., 1:2]
    return w.reshape(-1, k)


@dataclass
class QuantPart:
    """One packed weight [n, k] of a fused linear (q, k and v may be stored in different types)."""

    fmt: QuantFormat | Int8Format  # panels, or the integer path's records (by rows)
    packed: torch.Tensor  # uint8, fmt.packed_bytes(n, k)
    n: int
    k: int
    bias: torch.Tensor | None = None  # float32, padded to the panel width (the kernel's form)
    pairs: bool = False  # the codes' layout (code_positions, pairs_layout)
    # the integer path: x as Q8 blocks (1), or those and a residual plane, 16 bits (2; QRow in
    # quant_int8_kinds.h)
    act_planes: int = 1


def merge_parts(parts: list[QuantPart]) -> list[QuantPart]:
    """Adjacent parts of one format as one part: their panels (and padded biases) end to end.

    Why: q|k|v and gate|up of a GGUF model usually share a type. One kernel call then covers the
    fused output: a decode step makes 4 calls a layer instead of 7, and the two threads split 20
    panels instead of 12, 4 and 4. Each output's arithmetic is unchanged (a panel is computed
    alone), so the result is the same bit for bit. A part whose width is not a whole number of
    panels ends a run: its padding columns would land inside the merged output.
    """
    merged: list[QuantPart] = []
    for p in parts:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.fmt == p.fmt
            # the integer layout restacks its rows (concat_int8): no padding rows in between
            and (last.n % PANEL == 0 or isinstance(last.fmt, Int8Format))
            and (last.bias is None) == (p.bias is None)
            and last.packed.device == p.packed.device
            and last.pairs == p.pairs
            and last.act_planes == p.act_planes
        ):
            # integer records: the last part's padding rows must not shift the next part's bias
            head = last.bias if last.bias is None or not p.fmt.row_major else last.bias[: last.n]
            bias = None if p.bias is None or head is None else torch.cat([head, p.bias])
            if isinstance(p.fmt, Int8Format):
                packed = concat_int8(p.fmt, [last.packed, p.packed], [last.n, p.n], p.k)
            else:
                packed = torch.cat([last.packed, p.packed])
            merged[-1] = replace(last, packed=packed, n=last.n + p.n, bias=bias)
        else:
            merged.append(p)
    return merged
