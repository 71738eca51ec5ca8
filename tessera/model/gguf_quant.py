"""GGUF tensors kept quantized (`--quantization gguf`, `gguf_int8`, `gguf_int8_a16`): the blocks
of the types our kernels serve, decoded into the canonical codes/scales/mins of
tessera/kernels/quant_linear.py (and, for the integer path, packed by
tessera/kernels/quant_int8.py).

Each decoder reproduces gguf.quants' dequantization exactly: w = code * scale + min, where
code * scale is exact in float32, so the one rounding happens where gguf's does (the tests compare
bit for bit). Block layouts (GGML's, per row, K-positions along the row):

    Q4_0  [d f16][16 B: low nibbles k 0..15, high nibbles k 16..31]      w = d (q - 8)
    Q4_1  [d f16][m f16][16 B as Q4_0]                                   w = d q + m
    Q8_0  [d f16][32 x int8]                                             w = d q
    Q4_K  256 per block: [d f16][dmin f16][12 B: 8 x 6-bit sc, m][128 B: per 64, low nibbles
          the first 32, high nibbles the next 32]                       w = d sc_j q - dmin m_j
    Q5_K  256 per block: [d f16][dmin f16][12 B sc, m as Q4_K][32 B high bits][128 B as Q4_K]
                                                                         w = d sc_j q - dmin m_j
    Q6_K  256 per block: [128 B low 4 bits][64 B high 2 bits][16 x int8 sc][d f16]
                                                                         w = d sc_j (q - 32)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import gguf
import numpy as np
import torch

from tessera.kernels.quant_int8 import (
    K4S,
    K5S,
    Q4H,
    S8F2,
    S8H,
    U4H,
    U8F,
    Int8Format,
    pack_int8,
    pack_super,
)
from tessera.kernels.quant_layout import (
    Q4_FLOAT,
    Q4_HALF,
    Q8_FLOAT16,
    Q8_FLOAT_MIN,
    Q8_HALF,
    QuantFormat,
    QuantPart,
    pack_quantized,
)

logger = logging.getLogger(__name__)

T = gguf.GGMLQuantizationType
# The GGUF types a kernel format exists for; others are dequantized at load.
KERNEL_FORMATS: dict[gguf.GGMLQuantizationType, QuantFormat] = {
    T.Q4_0: Q4_HALF,
    T.Q4_1: Q4_HALF,
    T.Q5_0: Q8_HALF,  # (q - 16) d: a Q8_0 block with the same d, exactly
    T.Q8_0: Q8_HALF,
    T.Q4_K: Q4_FLOAT,
    T.Q5_1: Q8_FLOAT_MIN,  # codes 0..31 a byte each: 10 bits a weight where fp32 took 32
    T.Q5_K: Q8_FLOAT_MIN,
    T.Q6_K: Q8_FLOAT16,
}

# --quantization of the integer path -> its activation planes (quant_int8_kinds.h, QRow): Q8
# blocks (llama.cpp's form), or those and a plane of residuals, which holds x to 16 bits
INTEGER_PATHS = {"gguf_int8": 1, "gguf_int8_a16": 2}

# The GGUF types the integer path (--quantization gguf_int8) keeps, and its record kind for each.
INT8_FORMATS: dict[gguf.GGMLQuantizationType, Int8Format] = {
    T.Q4_0: Q4H,  # m = -8 d computed: the file's 18 bytes a block
    T.Q4_1: U4H,
    T.Q5_0: S8H,
    T.Q5_1: U8F,  # 5-bit codes with a min, as Q5_K's
    T.Q8_0: S8H,
    T.Q4_K: K4S,  # the file's 6-bit scales and f16 factors: 4.625 bits a weight, not 6
    T.Q5_K: K5S,  # as Q4_K, and a plane of 5th bits: 5.625 bits a weight, not 10
    T.Q6_K: S8F2,
}

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # codes [N, K], scales, mins [N, K/B]


@dataclass
class QuantizedTensor:
    """A 2-D GGUF weight [N, K] still in its file's blocks: `data` [N, bytes a row] (rows already
    in HF order). The loader returns these in place of float tensors for KERNEL_FORMATS types."""

    qtype: gguf.GGMLQuantizationType
    data: np.ndarray
    shape: torch.Size
    int8: bool = False  # pack for the integer path (quant_int8.py) instead of the panels
    act_planes: int = 1  # the integer path's activation planes (QuantPart.act_planes)

    @property
    def fmt(self) -> QuantFormat | Int8Format:
        return INT8_FORMATS[self.qtype] if self.int8 else KERNEL_FORMATS[self.qtype]

    def with_data(self, data: np.ndarray, shape: torch.Size) -> QuantizedTensor:
        """The same type and path (exact or integer) over other rows: a shard, or permuted
        rows."""
        return replace(self, data=data, shape=shape)

    def dequantize(self) -> torch.Tensor:
        """gguf's own float32 dequantization [N, K] (the `--quantization none` weights)."""
        w = gguf.quants.dequantize(self.data, self.qtype)
        return torch.from_numpy(np.array(w, dtype=np.float32).reshape(tuple(self.shape)))

    def decode(self) -> Decoded:
        n, k = self.shape
        return _DECODERS[self.qtype](np.ascontiguousarray(self.data).reshape(n, -1), n, k)

    def shard(
        self, dim: int, start: int, stop: int, name: str = ""
    ) -> QuantizedTensor | torch.Tensor:
        """A tensor-parallel rank's slice (tessera/distributed/sharding.py): rows of blocks
        (dim 0: whole rows), or whole blocks of every row (dim 1). A column slice off the block
        grid is dequantized (float32 tensor)."""
        if dim == 0:
            data = np.ascontiguousarray(self.data[start:stop]).copy()
            return self.with_data(data, torch.Size([stop - start, self.shape[1]]))
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        n, k = self.shape
        if start % block or stop % block:
            logger.warning("%s: columns %d:%d are not on %s's %d-value blocks; this shard is "
                           "dequantized", name, start, stop, self.qtype.name, block)
            return self.dequantize()[:, start:stop].contiguous().clone()
        blocks = np.ascontiguousarray(self.data).reshape(n, k // block, type_size)
        data = np.ascontiguousarray(blocks[:, start // block : stop // block])
        return self.with_data(data.reshape(n, -1).copy(), torch.Size([n, stop - start]))

    def pack(self, bias: torch.Tensor | None = None, pairs: bool = False) -> QuantPart:
        """The kernel's packed copy of this weight (built here; `data` may be dropped after), its
        codes in the layout for the activations' dtype (quant_linear.pairs_layout)."""
        n, k = self.shape
        fmt = self.fmt
        if isinstance(fmt, Int8Format):  # one code order: `pairs` does not apply
            if fmt.super_block:  # Q4_K, Q5_K: the file's own factors, not their products
                raw = np.ascontiguousarray(self.data).reshape(n, -1)
                factors = _K_FACTORS[self.qtype](raw, n, k)
                packed = pack_super(fmt, *factors)
            else:
                packed = pack_int8(fmt, *self.decode())
            return QuantPart(fmt, packed, n, k, bias, False, self.act_planes)
        packed = pack_quantized(fmt, *self.decode(), pairs=pairs)
        return QuantPart(fmt, packed, n, k, bias, pairs)


def _blocks(raw: np.ndarray, n: int, block_bytes: int) -> np.ndarray:
    return raw.reshape(n, -1, block_bytes)  # [N, blocks a row, bytes a block]


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles_split16(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are k 0..15, high nibbles k 16..31."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


def _q4_0(raw: np.ndarray, n: int, k: int) -> Decoded:
    b = _blocks(raw, n, 18)
    d = _half(b[..., 0:2])
    codes = _nibbles_split16(b[..., 2:]).reshape(n, k)
    return codes, d, (d.astype(np.float32) * np.float32(-8)).astype(np.float16)  # exact in fp16


def _q4_1(raw: np.ndarray, n: int, k: int) -> Decoded:
    b = _blocks(raw, n, 20)
    return _nibbles_split16(b[..., 4:]).reshape(n, k), _half(b[..., 0:2]), _half(b[..., 2:4])


def _q5_0(raw: np.ndarray, n: int, k: int) -> Decoded:
    """Q5_0 as the Q8_0 block of the same values: int8 codes q - 16 (q = 5 bits, the 5th of K
    position j is bit j of the block's 32-bit qh) and the block's fp16 d. Why: llama.cpp falls
    back to Q5_0 where a row is not a multiple of 256 (Gemma 3 270M's 640-wide rows), and the
    Q8_0 kernels of both paths then serve it, 8.5 bits a weight instead of float32."""
    b = _blocks(raw, n, 22)
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [N, nb, 1]
    high = (qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)  # [N, nb, 32]
    q = _nibbles_split16(b[..., 6:]).astype(np.int16) | (high.astype(np.int16) << 4)
    return (q - 16).astype(np.int8).reshape(n, k), _half(b[..., 0:2]), None


def _q5_1(raw: np.ndarray, n: int, k: int) -> Decoded:
    """Q5_1: codes q (5 bits, as Q5_0's) with the block's fp16 d and min m, q d + m."""
    b = _blocks(raw, n, 24)
    qh = np.ascontiguousarray(b[..., 4:8]).view("<u4")  # [N, nb, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
    codes = _nibbles_split16(b[..., 8:]) | (high << np.uint8(4))
    d = _half(b[..., 0:2]).astype(np.float32).reshape(n, -1)
    m = _half(b[..., 2:4]).astype(np.float32).reshape(n, -1)
    return codes.reshape(n, k), d, m


def _q8_0(raw: np.ndarray, n: int, k: int) -> Decoded:
    b = _blocks(raw, n, 34)
    return np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k), _half(b[..., 0:2]), None


def _q4_k_factors(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, ...]:
    """Q4_K as stored: codes [N, K] 0..15, d and dmin [N, K / 256] (f16), and the 6-bit sc and
    m [N, K / 256, 8]."""
    b = _blocks(raw, n, 144)
    sc, m = _q4_k_scale_min(b[..., 4:16])  # [N, nb, 8] each
    qs = b[..., 16:].reshape(n, -1, 4, 32)  # per 64 K-positions: 32 bytes
    codes = np.stack([qs & np.uint8(15), qs >> np.uint8(4)], axis=-2).reshape(n, k)
    return codes, _half(b[..., 0:2]), _half(b[..., 2:4]), sc, m


def _k_products(codes, d, dmin, sc, m) -> Decoded:
    """A K-quant's factors as codes, fp32 scales d sc and mins -dmin m (both exact)."""
    n = codes.shape[0]
    scales = (d.astype(np.float32)[..., None] * sc.astype(np.float32)).reshape(n, -1)
    mins = -(dmin.astype(np.float32)[..., None] * m.astype(np.float32)).reshape(n, -1)
    return codes, scales, mins


def _q4_k(raw: np.ndarray, n: int, k: int) -> Decoded:
    return _k_products(*_q4_k_factors(raw, n, k))


def _q4_k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (GGML's get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q5_k_factors(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, ...]:
    """Q5_K as stored: codes [N, K] 0..31, and d, dmin, sc, m as _q4_k_factors'."""
    b = _blocks(raw, n, 176)
    sc, m = _q4_k_scale_min(b[..., 4:16])  # [N, nb, 8] each
    qh = b[..., 16:48]  # [N, nb, 32]: bit j of byte l is the 5th bit of K 32 j + l
    qs = b[..., 48:].reshape(n, -1, 4, 32)  # per 64 K-positions: 32 bytes, as Q4_K
    low = np.stack([qs & np.uint8(15), qs >> np.uint8(4)], axis=-2).reshape(n, -1, 8, 32)
    high = np.stack([(qh >> np.uint8(j)) & np.uint8(1) for j in range(8)], axis=-2)
    codes = (low | (high << np.uint8(4))).reshape(n, k)
    return codes, _half(b[..., 0:2]), _half(b[..., 2:4]), sc, m


def _q5_k(raw: np.ndarray, n: int, k: int) -> Decoded:
    return _k_products(*_q5_k_factors(raw, n, k))


_K_FACTORS = {T.Q4_K: _q4_k_factors, T.Q5_K: _q5_k_factors}


def _q6_k(raw: np.ndarray, n: int, k: int) -> Decoded:
    b = _blocks(raw, n, 210)
    ql = b[..., 0:128].reshape(n, -1, 2, 64)  # per 128 K-positions: 64 bytes of low 4 bits
    qh = b[..., 128:192].reshape(n, -1, 2, 32)  # and 32 bytes of high 2 bits
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)  # [N, nb, 16]
    d = _half(b[..., 208:210]).astype(np.float32)[..., None]
    low = np.stack([ql & np.uint8(15), ql >> np.uint8(4)], axis=-2)  # [N, nb, 2, 2, 64]
    high = np.stack([(qh >> np.uint8(s)) & np.uint8(3) for s in (0, 2, 4, 6)], axis=-2)
    q = low.reshape(n, -1, 2, 4, 32) | (high.reshape(n, -1, 2, 4, 32) << np.uint8(4))
    codes = (q.astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    return codes, (d * sc).reshape(n, -1), None  # d * sc exact: 11 x 8 bits


_DECODERS = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0, T.Q4_K: _q4_k,
    T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}
