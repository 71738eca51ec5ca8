"""Linear layers on quantized (GGUF) weights: the C++ kernel (quant_linear.cpp) and its torch
fallback, over the packed layout of quant_layout.py.

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
Every build (TESSERA_CPU_ISA: avx512, avx2, portable) serves both dtypes: the avx2 and portable
builds dequantize a 64-row slice of a panel at a time into L1 and run linear_generic.h's fp32
tiles over it. Parts in the integer layout (quant_int8.py, `--quantization gguf_int8`) run the
integer kernel instead (quant_int8.h). Without a kernel (another device, or
TESSERA_DISABLE_CPP_KERNELS) a layer dequantizes its weights once, at construction, and runs
F.linear: never a dequantization per call.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from tessera.kernels.build import VEC_HEADER, load_extension
from tessera.kernels.hugepages import in_huge_pages
from tessera.kernels.linear import AMX_HEADER, GENERIC_HEADER, TILES_HEADER
from tessera.kernels.quant_int8 import Int8Format, dequantize_int8, dequantize_int8_rows
from tessera.kernels.quant_layout import (
    PANEL,
    QuantFormat,
    QuantPart,
    code_positions,
    dequantize_packed,
    dequantize_rows,
    merge_parts,
    with_layout,
)

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_linear.cpp")
_HEADERS = tuple(
    Path(__file__).with_name(h)
    for h in ("quant_formats.h", "quant_blocksum.h", "quant_exact.h", "quant_rows.h",
              "quant_int8.h", "quant_int8_kinds.h", "quant_int8_avx2.h", "quant_int8_pairs.h",
              "quant_int8_portable.h",
              "quant_int8_amx.h", "quant_int8_ops.h", "prefetch.h")
)
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


def _module() -> ModuleType | None:
    return load_extension(
        "tessera_quant_linear", _SOURCE,
        depends=(TILES_HEADER, AMX_HEADER, GENERIC_HEADER, VEC_HEADER, *_HEADERS),
    )


def int8_kernel_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when the integer kernel (quant_int8.h) serves activations of this dtype here: a CPU
    with a built kernel (any ISA), fp32 or bf16."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    return _module() is not None


def int8_dot_instruction() -> str | None:
    """The instruction the integer products run on in this build (vpdpbusd, vpmaddubsw or
    portable), or None without a kernel."""
    module = _module()
    return None if module is None else str(module.int8_dot_instruction())


def int8_amx_min_rows() -> int:
    """From how many rows a call runs Q4_0, Q4_1, Q8_0 and Q4_K on AMX-INT8 tiles (the same bits
    as the vpdpbusd loop, which takes fewer rows); 0 where this CPU, build or TESSERA_DISABLE_AMX
    leaves them on vector instructions."""
    module = _module()
    return 0 if module is None else int(module.int8_amx_min_rows())


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
def _positions_tensor(fmt: QuantFormat, pairs: bool) -> torch.Tensor:
    return torch.from_numpy(code_positions(fmt, pairs).astype(np.int32).reshape(-1))


def lookup_rows(
    fmt: QuantFormat | Int8Format,
    packed: torch.Tensor,
    k: int,
    ids: torch.Tensor,
    dtype: torch.dtype,
    pairs: bool = False,
) -> torch.Tensor:
    """Rows `ids` [T] of a packed weight -> [T, K] in `dtype`: the quantized embedding lookup.
    The C++ kernel where it runs (2048 ids: 40 ms in torch ops, a fraction of a ms there), else
    dequantize_rows; the same values either way."""
    module = (
        _module()
        if packed.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        else None
    )
    if isinstance(fmt, Int8Format):
        if module is None:  # T rows' records decoded in torch
            return dequantize_int8_rows(fmt, packed, k, ids).to(dtype)
        ids = ids.to(torch.int64).contiguous().view(-1)
        out = torch.empty(ids.numel(), k, dtype=dtype)
        module.int8_rows_out(packed, fmt.kernel_id, k, ids, out)
        return out
    if module is None:
        return dequantize_rows(fmt, packed, k, ids, pairs).to(dtype)
    ids = ids.to(torch.int64).contiguous().view(-1)
    out = torch.empty(ids.numel(), k, dtype=dtype)
    module.dequantize_rows_out(packed, fmt.kernel_id, k, ids, _positions_tensor(fmt, pairs), out)
    return out


class QuantLinear:
    """y = x @ [W_0; W_1; ...]^T (+ b): parts side by side along the output features, each
    written by the kernel into its columns of one output tensor. Callable like layers.Linear."""

    def __init__(self, parts: list[QuantPart], dtype: torch.dtype, device: torch.device):
        assert len({p.k for p in parts}) == 1, "fused parts share the input width"
        # the loader packs for the dtype already (pairs_layout); this covers a part packed for
        # another
        pairs = pairs_layout(dtype, device)
        self.parts = merge_parts([with_layout(p, pairs) for p in parts])
        self.in_features = parts[0].k
        self.out_features = sum(p.n for p in parts)
        self.int8 = [isinstance(p.fmt, Int8Format) for p in self.parts]
        module = _module() if quant_kernel_supported(dtype, device) else None
        self._kernel = None if module is None else module.quant_linear_out
        self._int8_kernel = None if module is None else module.quant_linear_int8_out
        self._dense_min_rows = DENSE_MIN_ROWS.get(dtype, 0)
        # __call__'s fast path: one part on a kernel (the integer one, or through _run)
        self._one_part = len(self.parts) == 1 and self._kernel is not None
        self._one_int8 = self._one_part and self.int8[0]
        self._dense: list[torch.Tensor] | None = None
        if self._kernel is not None:
            for p in self.parts:  # streamed whole at every step (hugepages.py says why)
                p.packed = in_huge_pages(p.packed)
        else:
            logger.warning(
                "quantized linear: no C++ kernel for %s on %s; its weights are dequantized once "
                "(memory of dense weights)",
                dtype,
                device,
            )
            self._dense = [_dequantize_part(p).to(dtype) for p in self.parts]

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight this layer streams per call (and holds)."""
        return sum(p.packed.numel() for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        if self._one_part and x.dim() == 2 and x.stride(1) == 1:
            # the common call (one part, a flat batch): ~4 us of Python less than the general
            # path, which at batch-1 decode's 121 calls a step is ~7% of the step; the kernel
            # called here, not through _run (another ~1 us a call)
            p = self.parts[0]
            y = x.new_empty(x.shape[0], p.n)
            if self._one_int8:
                self._int8_kernel(x, p.packed, p.fmt.kernel_id, p.n, p.bias, y, p.act_planes)
            else:
                self._run(0, x, y)
            return y
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self._kernel is None:
            return self._fallback(x2).view(*lead, self.out_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=x2.dtype, device=x2.device)
        col = 0
        for i, p in enumerate(self.parts):
            out = y if len(self.parts) == 1 else y[:, col : col + p.n]
            self._run(i, x2, out)
            col += p.n
        return y.view(*lead, self.out_features)

    def _run(self, i: int, x: torch.Tensor, out: torch.Tensor) -> None:
        p = self.parts[i]
        if self.int8[i]:
            assert self._int8_kernel is not None
            self._int8_kernel(x, p.packed, p.fmt.kernel_id, p.n, p.bias, out, p.act_planes)
        else:
            assert self._kernel is not None
            self._kernel(x, p.packed, p.fmt.kernel_id, p.n, p.bias, out, self._dense_min_rows)

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        assert self._dense is not None
        outs = []
        for p, w in zip(self.parts, self._dense, strict=True):
            b = None if p.bias is None else p.bias[: p.n].to(x.dtype)
            outs.append(F.linear(x, w.to(x.dtype), b))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _dequantize_part(p: QuantPart) -> torch.Tensor:
    """The float32 weights [n, k] of a part, in either layout."""
    if isinstance(p.fmt, Int8Format):
        return dequantize_int8(p.fmt, p.packed, p.n, p.k)
    return dequantize_packed(p.fmt, p.packed, p.n, p.k, p.pairs)


def pad_bias(bias: torch.Tensor) -> torch.Tensor:
    """bias [N] -> float32 [N rounded up to the panel width], zero-padded, on bias's device."""
    n = bias.numel()
    out = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32, device=bias.device)
    out[:n] = bias.reshape(-1).float()
    return out
