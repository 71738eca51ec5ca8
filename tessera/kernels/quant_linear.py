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

The kernel's result equals the dense kernel (linear.py) on the gguf-dequantized weights bit for
bit, for every row count; the fallback (no AVX-512 build, or another device) dequantizes with torch
on every call and runs F.linear: the same memory, much slower.
"""

from __future__ import annotations

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
PANEL = 48  # output features per panel: kPanel in linear_tiles.h
# Row count from which a panel is dequantized once into a dense panel and the dense tiles run
# over it (same result, bit for bit); below it each block is dequantized in registers for every
# row. Measured on 30 layers of the default model's Q4_1 shapes (ms, registers / dense panel):
#   fp32: M=8 17.5 / 28.7, M=16 29.9 / 37.6, M=32 ~50 / ~47, M=64 100 / 65, M=512 869 / 624
#   bf16: M=8 33.6 / 48.7, M=16 78.9 / 60.5, M=32 134 / 109, M=64 180 / 127, M=512 1360 / 977
# (on two cores shared with other jobs: differences under ~15% are noise).
# With a dense way of one row block, each 64-wide K slice of a panel is dequantized into L1 once and
# every row tile runs over it (linear_tiles.h); prefill sizes dequantize whole panels into L2.
# bf16 on a CPU with AMX ignores the threshold: every M dequantizes panels to bf16 and runs the AMX
# tiles, as the dense bf16 kernel does there (linear_amx.h), so the two stay equal bit for bit.
DENSE_MIN_ROWS = {torch.float32: 32, torch.bfloat16: 16}


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
    def record_bytes(self) -> int:
        scale_bytes = PANEL * np.dtype(self.scale_dtype).itemsize
        return self.code_bytes + scale_bytes * (2 if self.has_min else 1)

    def packed_bytes(self, n: int, k: int) -> int:
        return -(-n // PANEL) * (k // self.block) * self.record_bytes


Q4_HALF = QuantFormat("q4_half", 0, 4, 32, np.float16, True)
Q4_FLOAT = QuantFormat("q4_float", 1, 4, 32, np.float32, True)
Q8_HALF = QuantFormat("q8_half", 2, 8, 32, np.float16, False)
Q8_FLOAT16 = QuantFormat("q8_float16", 3, 8, 16, np.float32, False)


def _module() -> ModuleType | None:
    return load_extension("tessera_quant_linear", _SOURCE, depends=(TILES_HEADER, AMX_HEADER))


def quant_kernel_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when the C++ kernel serves activations of this dtype on this device."""
    if torch.device(device).type != "cpu":
        return False
    module = _module()
    return module is not None and str(dtype).removeprefix("torch.") in module.supported_dtypes()


def pack_quantized(
    fmt: QuantFormat, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None
) -> torch.Tensor:
    """codes [N, K] (uint8 0..15 for 4-bit, int8 for 8-bit), scales/mins [N, K / block] -> the
    kernel's panels as one uint8 tensor. N is padded to a multiple of 48 with zero weights."""
    n, k = codes.shape
    if k % fmt.block:
        raise ValueError(f"K ({k}) is not a multiple of {fmt.name}'s block size {fmt.block}")
    nb = k // fmt.block
    n_pad = -(-n // PANEL) * PANEL
    codes = np.ascontiguousarray(codes).view(np.uint8)
    if fmt.bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))  # k = 2j low nibble, 2j+1 high
    parts = [_panels(codes.reshape(n, nb, -1), n_pad)]
    for table in (scales, mins) if fmt.has_min else (scales,):
        assert table is not None
        as_bytes = np.ascontiguousarray(table, dtype=fmt.scale_dtype).view(np.uint8)
        parts.append(_panels(as_bytes.reshape(n, nb, -1), n_pad, item=np.dtype(fmt.scale_dtype).itemsize))
    packed = np.concatenate(parts, axis=2)  # [P, nb, record]
    assert packed.shape[2] == fmt.record_bytes
    return torch.from_numpy(np.ascontiguousarray(packed).reshape(-1))


def _panels(rows: np.ndarray, n_pad: int, item: int = 1) -> np.ndarray:
    """[N, nb, L * item] bytes -> [P, nb, L * 48 * item]: per block, L entries of 48 outputs."""
    n, nb, width = rows.shape
    padded = np.zeros((n_pad, nb, width), dtype=np.uint8)
    padded[:n] = rows
    grouped = padded.reshape(n_pad // PANEL, PANEL, nb, width // item, item)
    return grouped.transpose(0, 2, 3, 1, 4).reshape(n_pad // PANEL, nb, -1)


def _codes_and_scales(
    fmt: QuantFormat, records: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """records [..., nb, record_bytes] -> codes [..., nb, block, 48] (as float32), scales and
    mins [..., nb, 48] float32."""
    lead = records.shape[:-1]
    raw = records[..., : fmt.code_bytes].reshape(*lead, -1, PANEL)
    if fmt.bits == 4:
        codes = torch.stack([raw & 15, raw >> 4], dim=-2).reshape(*lead, fmt.block, PANEL).float()
    else:
        codes = raw.view(torch.int8).float()
    scale_dtype = torch.float16 if fmt.scale_dtype is np.float16 else torch.float32
    width = PANEL * np.dtype(fmt.scale_dtype).itemsize
    tables = [
        records[..., fmt.code_bytes + i * width : fmt.code_bytes + (i + 1) * width]
        .contiguous()
        .view(scale_dtype)
        .float()
        for i in range(2 if fmt.has_min else 1)
    ]
    return codes, tables[0], tables[1] if fmt.has_min else None


def dequantize_packed(fmt: QuantFormat, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The float32 weights [N, K] a packed tensor holds (gguf's values, bit for bit)."""
    nb = k // fmt.block
    records = packed.view(-1, nb, fmt.record_bytes)  # [P, nb, record]
    codes, scales, mins = _codes_and_scales(fmt, records)
    w = codes * scales.unsqueeze(-2)  # exact: a code times an fp16/fp32 scale fits in fp32
    if mins is not None:
        w = w + mins.unsqueeze(-2)  # the one rounding, as gguf's q * d + m
    return w.permute(0, 3, 1, 2).reshape(-1, k)[:n]  # [P, 48, nb, block] -> [N, K]


def dequantize_rows(fmt: QuantFormat, packed: torch.Tensor, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Float32 rows `ids` [T] of a packed weight -> [T, K]: an embedding lookup that reads only
    the panels' bytes of those rows (the embedding and a tied lm_head share one packed copy)."""
    nb = k // fmt.block
    records = packed.view(-1, nb, fmt.record_bytes)[ids // PANEL]  # [T, nb, record] (48 rows each)
    # each row's own lane of the bytes first, then decode: 1/48 of the work of decoding the
    # panels (1.1 ms -> see benchmarks/step_profile.py, at 16 ids of the default model)
    lane = (ids % PANEL).view(-1, 1, 1)
    t, scale_bytes = ids.numel(), np.dtype(fmt.scale_dtype).itemsize
    raw = records[..., : fmt.code_bytes].reshape(t, nb, -1, PANEL)
    raw = raw.gather(-1, lane.unsqueeze(-1).expand(t, nb, raw.shape[2], 1)).squeeze(-1)
    if fmt.bits == 4:
        codes = torch.stack([raw & 15, raw >> 4], dim=-1).reshape(t, nb, -1).float()  # [T, nb, block]
    else:
        codes = raw.view(torch.int8).float()
    tables = records[..., fmt.code_bytes :].reshape(t, nb, -1, PANEL, scale_bytes)
    tables = tables.gather(-2, lane.view(-1, 1, 1, 1, 1).expand(t, nb, tables.shape[2], 1,
                                                                 scale_bytes)).squeeze(-2)
    scale_dtype = torch.float16 if fmt.scale_dtype is np.float16 else torch.float32
    tables = tables.contiguous().view(scale_dtype).squeeze(-1).float()  # [T, nb, 1 or 2]
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


class QuantLinear:
    """y = x @ [W_0; W_1; ...]^T (+ b): parts side by side along the output features, each
    written by the kernel into its columns of one output tensor. Callable like layers.Linear."""

    def __init__(self, parts: list[QuantPart], dtype: torch.dtype, device: torch.device):
        assert len({p.k for p in parts}) == 1, "fused parts share the input width"
        self.parts = merge_parts(parts)
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
            w = dequantize_packed(p.fmt, p.packed, p.n, p.k).to(x.dtype)
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
        ):
            bias = None if p.bias is None or last.bias is None else torch.cat([last.bias, p.bias])
            merged[-1] = QuantPart(last.fmt, torch.cat([last.packed, p.packed]), last.n + p.n, p.k, bias)
        else:
            merged.append(p)
    return merged


def pad_bias(bias: torch.Tensor) -> torch.Tensor:
    """bias [N] -> float32 [N rounded up to the panel width], zero-padded, on bias's device."""
    n = bias.numel()
    out = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32, device=bias.device)
    out[:n] = bias.reshape(-1).float()
    return out
