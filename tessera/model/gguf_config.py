"""A GGUF file's metadata as a `ModelArchConfig`: llama.cpp's keys (`{arch}.block_count`,
`{arch}.attention.head_count_kv`, ...) mapped to HF's config fields, including what llama.cpp
stores elsewhere than HF does (RoPE scaling as tensors of per-frequency factors, the end-of-turn
token by its text, MoE routing by architecture). The tensors themselves: gguf_loader.py.
"""

from __future__ import annotations

import logging
import math

import gguf
import numpy as np

from tessera.model.config import ModelArchConfig
from tessera.model.registry import GGUF_ARCHITECTURES, GGUF_LLAMA_WITH_EXPERTS, has_qkv_bias, traits

logger = logging.getLogger(__name__)

_END_OF_TURN = {"gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>", "phi3": "<|end|>"}


def read_field(reader: gguf.GGUFReader, key: str, default=None):
    """The value of metadata `key`, or `default` where the file has none."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(
    reader: gguf.GGUFReader,
    path: str,
    shapes: dict[str, tuple[int, ...]],
    rope: dict[str, np.ndarray],
) -> ModelArchConfig:
    arch = read_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    architecture, _ = GGUF_ARCHITECTURES[arch]
    num_experts = int(read_field(reader, f"{arch}.expert_count", 0) or 0)
    if arch == "llama" and num_experts:
        architecture = GGUF_LLAMA_WITH_EXPERTS
    if num_experts and not traits(architecture).moe:
        raise ValueError(f"{path}: GGUF architecture {arch!r} with {arch}.expert_count "
                         f"{num_experts} is not supported")

    def key(name: str, default=None):
        value = read_field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    # llama.cpp: a head is key_length wide (else hidden / heads) and RoPE rotates
    # rope.dimension_count of its dims (fewer under Phi-4-mini's partial rotary factor)
    head_dim = int(read_field(reader, f"{arch}.attention.key_length", 0)
                   or hidden_size // num_heads)
    rotary_dim = int(read_field(reader, f"{arch}.rope.dimension_count", 0) or head_dim)
    if rotary_dim > head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count ({rotary_dim}) is larger than "
                         f"a head ({head_dim} dims)")
    rope_theta = float(key("rope.freq_base", 10000.0))
    eos_ids: list[int] = []
    for tok_key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tok = read_field(reader, f"tokenizer.ggml.{tok_key}")
        if tok is not None and int(tok) not in eos_ids:
            eos_ids.append(int(tok))
    bos = read_field(reader, "tokenizer.ggml.bos_token_id")

    # The embedding's rows are the model's vocabulary (it may be padded past the token list).
    vocab_size = int(shapes["token_embd.weight"][0])
    num_layers = int(key("block_count"))
    family = traits(architecture)
    # 0: none (llama.cpp's phi3 converter writes 0 for a model without a window)
    window = read_field(reader, f"{arch}.attention.sliding_window") or None
    layer_types: tuple[str, ...] = ()
    local_theta = None
    if arch in _END_OF_TURN:
        end_of_turn = _token_id(reader, _END_OF_TURN[arch])
        if end_of_turn is not None and end_of_turn not in eos_ids:
            eos_ids.append(end_of_turn)
    if family.gemma_norms and window is not None:
        # llama.cpp's fixed patterns: Gemma 2 alternates local and global layers from a
        # local one; Gemma 3 has five local layers to one global, with a local base of 10k
        if arch == "gemma2":
            layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(num_layers))
        else:
            layer_types = tuple("sliding_attention" if (i + 1) % 6 else "full_attention"
                                for i in range(num_layers))
            local_theta = 10000.0
    return ModelArchConfig(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, arch, path, rope, rope_theta, rotary_dim,
                                   int(key("context_length"))),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias=has_qkv_bias(architecture),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        sliding_window=None if window is None else int(window),
        layer_types=layer_types,
        rope_local_base_freq=local_theta,
        query_pre_attn_scalar=float(head_dim) if family.gemma_norms else None,
        attn_logit_softcapping=_optional_float(reader, f"{arch}.attn_logit_softcapping"),
        final_logit_softcapping=_optional_float(reader, f"{arch}.final_logit_softcapping"),
        partial_rotary_factor=rotary_dim / head_dim,
        **_moe_config(reader, arch, num_experts, shapes),
    )


# llama.cpp's graphs: qwen3moe and llama (Mixtral) renormalise the top-k weights, olmoe and
# qwen2moe not
_RENORMALIZED = {"qwen3moe": True, "llama": True, "olmoe": False, "qwen2moe": False}


def _moe_config(reader: gguf.GGUFReader, arch: str, num_experts: int,
                shapes: dict[str, tuple[int, ...]]) -> dict:
    """The MoE fields of `ModelArchConfig` from llama.cpp's metadata (none for a dense model).
    Every layer is sparse in llama.cpp's MoE graphs; the expert width is its own key
    (qwen3moe) or that of the expert tensors."""
    if not num_experts:
        return {}
    width = read_field(reader, f"{arch}.expert_feed_forward_length")
    if width is None:  # the experts' own rows (3-D tensors, or one tensor per expert)
        width = (shapes["blk.0.ffn_gate_exps.weight"][1] if "blk.0.ffn_gate_exps.weight" in shapes
                 else shapes["blk.0.ffn_gate.0.weight"][0])
    norm = read_field(reader, f"{arch}.expert_weights_norm")
    shared = read_field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared is None and "blk.0.ffn_gate_shexp.weight" in shapes:
        shared = shapes["blk.0.ffn_gate_shexp.weight"][0]
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(read_field(reader, f"{arch}.expert_used_count", 0) or 0),
        moe_intermediate_size=int(width),
        norm_topk_prob=_RENORMALIZED.get(arch, True) if norm is None else bool(norm),
        shared_expert_intermediate_size=int(shared or 0),
    )


def _optional_float(reader: gguf.GGUFReader, key: str) -> float | None:
    value = read_field(reader, key)
    return None if value is None else float(value)


def _token_id(reader: gguf.GGUFReader, text: str) -> int | None:
    """The id of a token by its text in the GGUF's vocabulary, None if absent."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return None
    target = text.encode()
    for i, part in enumerate(field.data):
        if bytes(field.parts[part]) == target:
            return i
    return None


def _rope_scaling(
    reader: gguf.GGUFReader,
    arch: str,
    path: str,
    rope: dict[str, np.ndarray],
    rope_theta: float,
    rotary_dim: int,
    max_positions: int,
) -> dict | None:
    """HF's `rope_scaling` from llama.cpp's metadata and RoPE tensors: Llama 3's `rope_freqs`
    divisors, Phi-3's LongRoPE factors, or a linear factor. Anything else is refused, by name."""
    scaling_type = read_field(reader, f"{arch}.rope.scaling.type")
    attn_factor = _optional_float(reader, f"{arch}.rope.scaling.attn_factor")
    if "rope_freqs" in rope:
        return llama3_rope_scaling_from_factors(rope["rope_freqs"], rope_theta, rotary_dim)
    if "rope_factors_long" in rope or "rope_factors_short" in rope:
        return _longrope_scaling(reader, arch, path, rope, rotary_dim, max_positions)
    if attn_factor not in (None, 1.0):
        raise ValueError(f"{path}: {arch}.rope.scaling.attn_factor {attn_factor} without "
                         "rope_factors_long/rope_factors_short tensors is not supported")
    if scaling_type in (None, "none"):
        return None
    if scaling_type == "linear":
        return {
            "rope_type": "linear",
            "factor": float(read_field(reader, f"{arch}.rope.scaling.factor")),
        }
    raise ValueError(
        f"{path}: {arch}.rope.scaling.type {scaling_type!r} is not supported (none, linear, "
        "llama3 by rope_freqs, longrope by rope_factors_long and rope_factors_short)"
    )


def _longrope_scaling(
    reader: gguf.GGUFReader,
    arch: str,
    path: str,
    rope: dict[str, np.ndarray],
    rotary_dim: int,
    max_positions: int,
) -> dict:
    """Phi-3's LongRoPE as llama.cpp's converter stores it: the short and long per-frequency
    divisors as tensors, the pre-training length as rope.scaling.original_context_length and
    the cos/sin scale as rope.scaling.attn_factor (absent: HF's default from the two lengths).
    HF's switch between the two factor sets (long beyond the original length) is the model's."""
    scaling_type = read_field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none", "longrope"):
        raise ValueError(f"{path}: {arch}.rope.scaling.type {scaling_type!r} with "
                         "rope_factors_long/rope_factors_short tensors is not supported")
    factors: dict[str, list[float]] = {}
    for name in ("rope_factors_short", "rope_factors_long"):
        if name not in rope:
            raise ValueError(f"{path}: LongRoPE needs both rope_factors_short and "
                             f"rope_factors_long; {name}.weight is missing")
        if rope[name].shape[0] != rotary_dim // 2:
            raise ValueError(f"{path}: {name}.weight has {rope[name].shape[0]} entries, expected "
                             f"{rotary_dim // 2} ({arch}.rope.dimension_count / 2)")
        factors[name.removeprefix("rope_factors_") + "_factor"] = rope[name].tolist()
    original = read_field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.rope.scaling.original_context_length"
                         " (LongRoPE's pre-training length)")
    scaling: dict = {
        "rope_type": "longrope",
        **factors,
        "original_max_position_embeddings": int(original),
        "max_position_embeddings": max_positions,
    }
    attn_factor = _optional_float(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = attn_factor
    return scaling


def llama3_rope_factors(scaling: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama-3 RoPE scaling (what llama.cpp stores as rope_freqs)."""
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
    # new_inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq; divisor = inv / new
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def llama3_rope_scaling_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict:
    """Recover HF's llama3 `rope_scaling` from llama.cpp's rope_freqs divisors.

    The divisors are 1 at high frequencies, `factor` at low ones and blend between. Between the
    two, `smooth = (orig / wavelen - low) / (high - low)` is linear in 1/wavelen, which fixes two
    of (orig, low, high); we assume low_freq_factor = 1, as in every Llama 3.x release, solve for
    the others, and check the result reproduces every divisor.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise ValueError(f"rope_freqs has {factors.shape[0]} entries, expected {head_dim // 2}")
    factor = float(factors.max())
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = inv_freq / (2 * math.pi)  # 1 / wavelen
    mid = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    candidates = [
        {
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    ]
    if mid.sum() >= 2 and factor > 1:
        smooth = (factor / factors[mid] - 1) / (factor - 1)
        slope, intercept = np.polyfit(x[mid], smooth, 1)  # smooth = orig/(h-1) * x - 1/(h-1)
        high = 1 - 1 / intercept
        orig = slope * (high - 1)
        candidates.insert(
            0,
            {
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": float(round(high, 3)),
                "original_max_position_embeddings": int(round(orig)),
            },
        )
    for params in candidates:
        scaling = {"rope_type": "llama3", **params}
        if np.allclose(llama3_rope_factors(scaling, rope_theta, head_dim), factors, rtol=1e-3):
            return scaling
    raise ValueError("rope_freqs does not match Llama-3 RoPE scaling; this GGUF is not supported")
