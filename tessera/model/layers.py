"""Building blocks of Llama-family models: linear, RMSNorm, SiLU*up, RoPE; each uses a CPU kernel
from tessera/kernels where one serves the tensors, torch ops elsewhere."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from tessera.kernels.fused import fused_ops_for
from tessera.kernels.linear import PackedLinearWeight, linear_kernel_supported
from tessera.kernels.quant_layout import QuantPart
from tessera.kernels.quant_linear import QuantLinear, lookup_rows, pad_bias, pairs_layout
from tessera.model.gguf_quant import QuantizedTensor

Weight = torch.Tensor | QuantizedTensor  # a loaded weight: dense (HF layout) or GGUF blocks


def _mkldnn_linear_ok(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _mkldnn_packs(weight.dtype)
    )


@functools.cache
def _mkldnn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU: its bf16 path needs AVX-512 (bw, vl,
    dq) or AVX-NE-CONVERT and raises elsewhere (an AVX2-only EPYC), where F.linear serves."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


class Linear:
    """y = x @ W^T (+ b). On CPU the weight is packed once for our C++ kernel
    (tessera/kernels/linear.py: 1.5x oneDNN at decode sizes, within ~5% at prefill sizes, and
    batch-invariant); without it, for oneDNN's blocked layout (plain `F.linear` reaches only
    ~12 GB/s of weights at M=1 here). Elsewhere (CUDA) plain F.linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.weight: torch.Tensor | None = weight.contiguous()
        self.bias = bias.contiguous() if bias is not None else None
        self.kernel: PackedLinearWeight | None = None
        self.packed: torch.Tensor | None = None
        if pack and linear_kernel_supported(self.weight):
            self.kernel = PackedLinearWeight(self.weight, self.bias)
            self.weight = None  # the panels are the only copy kept
        elif pack and _mkldnn_linear_ok(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight this layer holds and streams per call."""
        t = (
            self.kernel.panels
            if self.kernel is not None
            else self.packed
            if self.packed is not None
            else self.weight
        )
        assert t is not None
        return t.numel() * t.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def make_linear(
    parts: list[Weight], bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device
) -> Linear | QuantLinear:
    """One linear over `parts` stacked along the output features (fused q|k|v, gate|up).

    All parts quantized: a QuantLinear on their blocks (each part keeps its own GGUF type).
    Otherwise dense: quantized parts are dequantized (gguf's float32 values) and cast to `dtype`.
    """
    if all(isinstance(p, QuantizedTensor) for p in parts):
        packed: list[QuantPart] = []
        row = 0
        for p in parts:
            assert isinstance(p, QuantizedTensor)
            n = p.shape[0]
            # the bias is rounded to the compute dtype first, as the dense path's is
            b = None if bias is None else pad_bias(bias[row : row + n].to(dtype))
            packed.append(p.pack(b, pairs_layout(dtype, device)))
            row += n
        return QuantLinear([_to_device(q, device) for q in packed], dtype, device)
    dense = [_dense(p, dtype, device) for p in parts]
    weight = dense[0] if len(dense) == 1 else torch.cat(dense)
    return Linear(weight, None if bias is None else bias.to(device=device, dtype=dtype))


def _dense(w: Weight, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = w.dequantize() if isinstance(w, QuantizedTensor) else w
    return t.to(device=device, dtype=dtype)


def _to_device(part: QuantPart, device: torch.device) -> QuantPart:
    bias = None if part.bias is None else part.bias.to(device)
    return replace(part, packed=part.packed.to(device), bias=bias)


class Embedding:
    """Token ids [T] -> rows [T, hidden] in the compute dtype. A quantized table is looked up in
    the packed blocks it shares with a tied lm_head (one copy of the weights)."""

    def __init__(self, weight: torch.Tensor | QuantPart, dtype: torch.dtype):
        self.weight = weight
        self.dtype = dtype

    @property
    def weight_bytes(self) -> int:
        w = self.weight
        return w.packed.numel() if isinstance(w, QuantPart) else w.numel() * w.element_size()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, QuantPart):
            return lookup_rows(w.fmt, w.packed, w.k, ids, self.dtype, w.pairs)
        return F.embedding(ids, w)


class RMSNorm:
    """x / sqrt(mean(x^2) + eps) * w, normalised in float32 like the reference. On CPU one fused
    kernel call (tessera/kernels/fused.py); elsewhere torch ops."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight
        self.eps = eps
        self._fused = fused_ops_for(weight.device, weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None and x.dim() == 2 and x.stride(-1) == 1:
            return self._fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one dispatch instead of six
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """residual += delta (in place, the residual stream), then the norm of the sum."""
        if self._fused is not None and residual.dim() == 2 and delta.stride(-1) == 1:
            return self._fused.add_rms_norm_(residual, delta, self.weight, self.eps)
        residual.add_(delta)
        return self(residual)


class GeluTanhAndMul:
    """[n, 2I] (gate | up) -> gelu_tanh(gate) * up: Gemma's GeGLU (HF's gelu_pytorch_tanh)."""

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class SiluAndMul:
    """[n, 2I] (gate | up) -> silu(gate) * up, the MLP activation, fused on CPU."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self._fused = fused_ops_for(device, dtype)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._fused is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return self._fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def rope_inv_freq(
    head_dim: int, theta: float, rope_scaling: dict | None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] of the RoPE types whose frequencies do not depend on the
    position (default, linear, llama3, yarn; and longrope's short factors), and the factor HF
    multiplies into cos and sin (yarn's and longrope's "attention factor", else 1). `head_dim`
    here is the rotary dims (partial_rotary_factor applied)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = (rope_scaling or {}).get("rope_type", "default")
    if kind in ("default", "dynamic"):  # dynamic: the default below its original length
        return inv_freq.float(), 1.0
    assert rope_scaling is not None
    if kind == "linear":
        return (inv_freq / float(rope_scaling["factor"])).float(), 1.0
    if kind == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling.get("low_freq_factor", 1.0))
        high = float(rope_scaling.get("high_freq_factor", 4.0))
        old_len = float(rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled).float(), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, rope_scaling)
    if kind == "longrope":
        return _longrope(head_dim, theta, rope_scaling, long=False)
    raise ValueError(
        f"unsupported rope_scaling type {kind!r} "
        "(supported: default, linear, llama3, yarn, longrope, dynamic)"
    )


def _yarn(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp between the
    dims that rotate beta_fast and beta_slow times over the original length (HF's formulas, in
    float32 as HF computes them)."""
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    attention = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(dim: int, theta: float, scaling: dict, long: bool) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency divisors, `short_factor` within the original length and
    `long_factor` beyond it; cos and sin scaled by sqrt(1 + ln(factor) / ln(original))."""
    orig = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or float(scaling["max_position_embeddings"]) / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * theta**exponents), float(attention)


class RotaryEmbedding:
    """cos/sin of each token's position [num_tokens, head_dim] in HF's rotate-half layout (sin
    with its first half negated, see `apply_rope`), computed per step from the positions: no
    table of max_positions rows (a 131k-token Gemma 3 context would hold 256 MiB of them).

    Positions past a RoPE's original length: "longrope" switches to its long factors and
    "dynamic" raises the base, per token (HF decides once for a whole forward by its longest
    sequence, which would make a token's rotation depend on its batch). Within the original
    length both equal HF exactly. `rotary_dim` < head_dim: only the first dims rotate (Phi-4)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        rope_scaling: dict | None,
        dtype: torch.dtype,
        device: torch.device,
        rotary_dim: int | None = None,
    ):
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.theta = theta
        self.scaling = rope_scaling or {}
        self.kind = self.scaling.get("rope_type", "default")
        inv_freq, self.attention_factor = rope_inv_freq(self.rotary_dim, theta, rope_scaling)
        self.inv_freq = inv_freq.to(device)
        self.long_inv_freq: torch.Tensor | None = None
        if self.kind == "longrope":
            self.long_inv_freq = _longrope(self.rotary_dim, theta, self.scaling, long=True)[0].to(
                device
            )
        self.dtype = dtype
        self.device = device
        fused = fused_ops_for(device, dtype)
        self._fused = fused if self.rotary_dim == head_dim else None

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token: [num_tokens, rotary_dim] each. Once per step, shared by every
        layer that uses this RoPE."""
        pos = positions.to(torch.float32)
        inv = self._inv_freq_at(positions)  # [D/2] or [n, D/2]
        freqs = torch.outer(pos, inv) if inv.dim() == 1 else pos.unsqueeze(1) * inv  # [n, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, D]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        # rotate_half(x) * sin == cat(x2, x1) * (sin with its first half negated): saves an op
        half = self.rotary_dim // 2
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        return cos.to(self.dtype), sin.to(self.dtype)

    def _inv_freq_at(self, positions: torch.Tensor) -> torch.Tensor:
        if self.kind == "longrope":
            assert self.long_inv_freq is not None
            orig = int(self.scaling["original_max_position_embeddings"])
            beyond = (positions >= orig).unsqueeze(1)  # sequence length p + 1 > orig
            return torch.where(beyond, self.long_inv_freq, self.inv_freq)
        if self.kind == "dynamic" and positions.numel() and int(positions.max()) >= int(
            self.scaling["max_position_embeddings"]
        ):
            # HF: base * (factor * L / max_pos - (factor - 1)) ** (dim / (dim - 2)), L = p + 1
            dim, factor = self.rotary_dim, float(self.scaling["factor"])
            max_pos = float(self.scaling["max_position_embeddings"])
            length = (positions.to(torch.float64) + 1).clamp(min=max_pos)
            base = self.theta * (factor * length / max_pos - (factor - 1)) ** (dim / (dim - 2))
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim
            return (1.0 / base.unsqueeze(1) ** exponents).float().to(positions.device)
        return self.inv_freq

    def apply_(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
    ) -> None:
        """Rotate the first `num_heads` heads of each row of qkv [n, width] in place (q and k are
        adjacent at the start of the fused projection's output)."""
        if self._fused is not None and qkv.stride(-1) == 1:
            self._fused.rope_(qkv, cos, sin, num_heads, self.head_dim)
            return
        n = qkv.shape[0]
        heads = qkv[:, : num_heads * self.head_dim].view(n, num_heads, self.head_dim)
        rot = heads[..., : self.rotary_dim]
        rot.copy_(apply_rope(rot, cos.unsqueeze(1), sin.unsqueeze(1)))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] -> x*cos + rotate_half(x)*sin, HF's layout, where
    `signed_sin` is `RotaryEmbedding.sin` (first half negated, so the halves just swap)."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)
