"""Linear layers on quantized (GGUF) weights: the packed panel layout, the C++ kernel
(quant_linear.cpp) and its torch fallback.

A weight arrives decoded into a canonical form (tessera/model/gguf_quant.py): integer codes [N, K],
and per block of `block` K-positions a scale (and for the 4-bit formats a min), with

    w[n, k] = code[n, k] * scale[n, k // block] + min[n, k // block]

exactly as gguf's own dequantization computes it. `pack_quantized` lays it out in the kernel's
panels (48 outputs, one record per block, see quant_linear.cpp) and that packed tensor is the only
copy kept. Four kernel formats cover the five GGUF types:

| format | codes | block | scale, min | GGUF types | bits a weight |
| --- | --- | ---: | --- | --- | ---: |
| q4_half | 4-bit | 32 | fp16, fp16 | Q4_0 (min = -8 d), Q4_1 | 5 |
| q4_float | 4-bit | 32 | fp32, fp32 | Q4_K (d * sc, -dmin * m) | 6 |
| q8_half | int8 | 32 | fp16 | Q8_0 | 8.5 |
| q8_float16 | int8 | 16 | fp32 | Q6_K (q - 32, d * sc) | 10 |

Measured with `benchmarks/runner.py --compare-quantization --skip-hf` (default model, one run on
two shared cores of an Intel Xeon with AMX, so differences under ~15% are noise; tok/s, ratio to
dense bf16):

| workload | Q4_1 + fp32 act | Q4_1 + bf16 act | dense bf16 | dense fp32 |
| --- | ---: | ---: | ---: | ---: |
| decode batch 1 | 75.7 (1.10x) | 69.1 (1.00x) | 69.1 | 31.5 (0.46x) |
| decode batch 16 | 308.3 (0.64x) | 494.9 (1.03x) | 479.0 | 242.3 (0.51x) |
| decode batch 64 | 399.0 (0.58x) | 694.4 (1.01x) | 686.7 | 309.7 (0.45x) |
| prefill 1x512 | 581.9 (0.27x) | 1452.8 (0.69x) | 2116.0 | 530.0 (0.25x) |
| weights streamed a step | 96.4 MB | 96.4 MB | 269.0 MB | 537.9 MB |

bf16 activations run AMX tiles on dequantized blocks (linear_amx.h): from batch 16 up they keep
pace with dense bf16, which streams 2.8x the bytes; at batch 1 both are bound by the dequantizing
(Q4_1) and by the weight stream (dense) at about the same rate. fp32 activations are fastest at
batch 1 (the register way skips the bf16 rounding and pairing) and fall behind beyond it. The
prefill row predates 64-byte alignment of the AMX buffers: after it, 1531 against 1654 tok/s
dense bf16 in one slot.

bf16 activations on CPUs without AMX now run the block-sum form instead (quant_linear.cpp):
vdpbf16ps on the codes themselves, scaled once a block, one code path for every M. In-process
A/B against exact dequantization on an AMD EPYC (Zen 5, avx512_bf16, no AMX), 30 layers of the
default model's Q4_1 shapes, `benchmarks/quant_linear.py`: 0.62x the time at M = 1, 0.67x at 8,
0.72x at 16, 0.87x at 64, about the same at 512.

fp32 results (and bf16 on AMX) equal the dense kernel (linear.py) on the gguf-dequantized weights
bit for bit, for every row count; the block-sum form does not round weights to bf16, so it lands
closer to the fp32-weight result than the dense bf16 kernel, rows still independent of the batch.
The fallback (no AVX-512 build, or another device) dequantizes with torch on every call and runs
F.linear: the same memory, much slower.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from tessera.kernels.build import load_extension
from tessera.kernels.linear import AMX_HEADER, TILES_HEADER

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_linear.cpp")
_HEADERS = tuple(Path(__file__).with_name(h) for h in ("quant_formats.h", "quant_blocksum.h"))
PANEL = 48  # output features per panel: kPanel in linear_tiles.h
# fp32: the row count from which a panel is dequantized once into a dense panel and the dense
# tiles run over it (same result, bit for bit); below it each block is dequantized in registers
# for every row. Measured on 30 layers of the default model's Q4_1 shapes (ms, registers / dense):
#   M=8 17.5 / 28.7, M=16 29.9 / 37.6, M=32 ~50 / ~47, M=64 100 / 65, M=512 869 / 624
# (on two cores shared with other jobs: differences under ~15% are noise).
# With a dense way of one row block, each 64-wide K slice of a panel is dequantized into L1 once and
# every row tile runs over it (linear_tiles.h); prefill sizes dequantize whole panels into L2.
# bf16 has one way for every M: the block-sum form, or on a CPU with AMX exact dequantization into
# the AMX tiles, as the dense bf16 kernel does there (linear_amx.h).
DENSE_MIN_ROWS = {torch.float32: 32}


@dataclass(frozen=True)
class QuantFormat:
    """One packed layout the kernel streams; `kernel_id` is its FormatId in quant_linear.cpp."""

    name: str
    kernel_id: int
    bits: int
    block: int
    scale_dtype: type
    has_min: bool

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


def _module() -> ModuleType | None:
    return load_extension("tessera_quant_linear", _SOURCE, depends=(TILES_HEADER, AMX_HEADER, *_HEADERS))


def quant_kernel_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when the C++ kernel serves activations of this dtype on this device."""
    if torch.device(device).type != "cpu":
        return False
    module = _module()
    return module is not None and str(dtype).removeprefix("torch.") in module.supported_dtypes()


def pairs_layout(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel for activations of `dtype` on `device` reads codes in the pairs layout
    (code_positions): bf16 does (the block-sum form, quant_linear.cpp), except on a CPU that runs
    bf16 on AMX tiles; fp32 and the torch fallback read the natural one."""
    if dtype != torch.bfloat16 or not quant_kernel_supported(dtype, device):
        return False
    module = _module()
    return module is not None and module.bf16_reads_pairs()


@functools.cache
def code_positions(fmt: QuantFormat, pairs: bool) -> np.ndarray:
    """[block, 48] int64: where code (k, n) of a record lives in its code bytes, as a nibble
    index (4-bit: byte i holds nibbles 2i low, 2i + 1 high) or a byte index (8-bit).

    natural: K position by K position, 48 outputs each, so one 16-byte load gives one K position
      of 16 outputs (4-bit: K 2j low nibble, 2j + 1 high, in one byte).
    pairs: K positions in pairs, each output's two codes side by side, the lane order of
      vdpbf16ps's operand (quant_linear.cpp, code_pairs). 4-bit: 16-bit word 2n + p of the 192
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
    """codes [N, K] (uint8 0..15 for 4-bit, int8 for 8-bit), scales/mins [N, K / block] -> the
    kernel's panels as one uint8 tensor, codes in the layout `pairs` names (code_positions).
    N is padded to a multiple of 48 with zero weights."""
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
    if part.pairs == pairs:
        return part
    fmt = part.fmt
    records = part.packed.view(-1, part.k // fmt.block, fmt.record_bytes)
    index, shift = _code_bytes(fmt, part.pairs)
    raw = records[..., index.reshape(-1)]
    canonical = (raw >> shift.reshape(-1).to(torch.uint8)) & 15 if fmt.bits == 4 else raw
    codes = _lay_out_codes(fmt, canonical, pairs)
    packed = torch.cat([codes, records[..., fmt.code_bytes :]], dim=-1).reshape(-1)
    return QuantPart(fmt, packed, part.n, part.k, part.bias, pairs)


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


@functools.cache
def _positions_tensor(fmt: QuantFormat, pairs: bool) -> torch.Tensor:
    return torch.from_numpy(code_positions(fmt, pairs).astype(np.int32).reshape(-1))


def lookup_rows(
    fmt: QuantFormat, packed: torch.Tensor, k: int, ids: torch.Tensor, dtype: torch.dtype,
    pairs: bool = False,
) -> torch.Tensor:
    """Rows `ids` [T] of a packed weight -> [T, K] in `dtype`: the quantized embedding lookup.
    The C++ kernel where it runs (2048 ids: 40 ms in torch ops, a fraction of a ms there), else
    dequantize_rows; the same values either way."""
    module = _module() if packed.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None
    if module is None:
        return dequantize_rows(fmt, packed, k, ids, pairs).to(dtype)
    ids = ids.to(torch.int64).contiguous().view(-1)
    out = torch.empty(ids.numel(), k, dtype=dtype)
    module.dequantize_rows_out(packed, fmt.kernel_id, k, ids, _positions_tensor(fmt, pairs), out)
    return out


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

    fmt: QuantFormat
    packed: torch.Tensor  # uint8, fmt.packed_bytes(n, k)
    n: int
    k: int
    bias: torch.Tensor | None = None  # float32, padded to the panel width (the kernel's form)
    pairs: bool = False  # the codes' layout (code_positions, pairs_layout)


class QuantLinear:
    """y = x @ [W_0; W_1; ...]^T (+ b): parts side by side along the output features, each
    written by the kernel into its columns of one output tensor. Callable like layers.Linear."""

    def __init__(self, parts: list[QuantPart], dtype: torch.dtype, device: torch.device):
        assert len({p.k for p in parts}) == 1, "fused parts share the input width"
        # the loader packs for the dtype already (pairs_layout); this covers a part packed for another
        pairs = pairs_layout(dtype, device)
        self.parts = merge_parts([with_layout(p, pairs) for p in parts])
        self.in_features = parts[0].k
        self.out_features = sum(p.n for p in parts)
        module = _module() if quant_kernel_supported(dtype, device) else None
        self._kernel = None if module is None else module.quant_linear_out
        self._dense_min_rows = DENSE_MIN_ROWS.get(dtype, 0)
        if self._kernel is None:
            logger.warning(
                "quantized linear: no C++ kernel for %s on %s; dequantizing on every call (slow)",
                dtype, device,
            )

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight this layer streams per call (and holds)."""
        return sum(p.packed.numel() for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        if len(self.parts) == 1 and x.dim() == 2 and x.stride(1) == 1 and self._kernel is not None:
            # the common call (one part, a flat batch): ~4 us of Python less than the general
            # path, which at batch-1 decode's 121 calls a step is ~7% of the step
            p = self.parts[0]
            y = x.new_empty(x.shape[0], p.n)
            self._kernel(x, p.packed, p.fmt.kernel_id, p.n, p.bias, y, self._dense_min_rows)
            return y
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self._kernel is None:
            return self._fallback(x2).view(*lead, self.out_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=x2.dtype, device=x2.device)
        col = 0
        for p in self.parts:
            out = y if len(self.parts) == 1 else y[:, col : col + p.n]
            self._kernel(x2, p.packed, p.fmt.kernel_id, p.n, p.bias, out, self._dense_min_rows)
            col += p.n
        return y.view(*lead, self.out_features)

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for p in self.parts:
            w = dequantize_packed(p.fmt, p.packed, p.n, p.k, p.pairs).to(x.dtype)
            b = None if p.bias is None else p.bias[: p.n].to(x.dtype)
            outs.append(F.linear(x, w, b))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


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
            and last.n % PANEL == 0
            and (last.bias is None) == (p.bias is None)
            and last.packed.device == p.packed.device
            and last.pairs == p.pairs
        ):
            bias = None if p.bias is None or last.bias is None else torch.cat([last.bias, p.bias])
            merged[-1] = QuantPart(
                last.fmt, torch.cat([last.packed, p.packed]), last.n + p.n, p.k, bias, p.pairs
            )
        else:
            merged.append(p)
    return merged


def pad_bias(bias: torch.Tensor) -> torch.Tensor:
    """bias [N] -> float32 [N rounded up to the panel width], zero-padded, on bias's device."""
    n = bias.numel()
    out = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32, device=bias.device)
    out[:n] = bias.reshape(-1).float()
    return out
