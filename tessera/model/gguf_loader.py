"""GGUF files (llama.cpp's format) through the `gguf` package: metadata -> config, tensors -> HF.

Three things differ from an HF checkpoint and are undone here:
- names: `blk.{i}.attn_q.weight` -> `model.layers.{i}.self_attn.q_proj.weight` (see `_NAME_MAP`);
  fused tensors (Phi-3's `attn_qkv` and gate|up `ffn_up`) are cut by rows into their HF parts;
- quantisation: with `quantization="none"` every tensor is dequantised to float32 with
  `gguf.quants.dequantize`; with "gguf" or "gguf_int8", 2-D weights of a type our kernels serve
  (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) stay in their blocks as `QuantizedTensor`s
  (tessera/model/gguf_quant.py), the rest is dequantised;
- llama.cpp's converter permutes the rows of Llama's Q and K weights so that its interleaved RoPE
  (pairs (2j, 2j+1)) equals HF's rotate_half RoPE (pairs (j, j + head_dim/2)); `_unpermute_rows`
  puts them back. Qwen2 uses NEOX-style RoPE in llama.cpp and is stored unpermuted.
Llama 3.x GGUFs carry RoPE scaling as a `rope_freqs.weight` tensor of per-frequency divisors
rather than metadata; `llama3_rope_scaling_from_factors` recovers HF's `rope_scaling` dict.
Phi-3's LongRoPE comes the same way, as `rope_factors_short`/`rope_factors_long` tensors.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re

import gguf
import numpy as np
import torch

from tessera.distributed.sharding import ShardPlan
from tessera.model.config import ModelArchConfig
from tessera.model.gguf_quant import INT8_FORMATS, KERNEL_FORMATS, QuantizedTensor
from tessera.model.registry import (
    GGUF_ARCHITECTURES,
    GGUF_LLAMA_WITH_EXPERTS,
    has_qkv_bias,
    traits,
)

logger = logging.getLogger(__name__)

_NAME_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # q|k|v in one tensor (Phi-3), split at load
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    # Qwen2-MoE's shared expert and its gate (a [hidden] vector in the file, [1, hidden] in HF)
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# llama.cpp's 3-D expert tensors [E, out, in]: one HF projection per expert
_EXPERT_NAME_MAP = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                    "ffn_down_exps": "down_proj"}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the norm before the MLP there, and
# post_attention_norm the one on the attention output (HF's post_attention_layernorm)
_GEMMA_LAYER_NAME_MAP = {
    **_LAYER_NAME_MAP,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Names that mean something else in one family: llama.cpp's `phi3` stores gate|up as one
# `ffn_up` [2 * intermediate, hidden], gate rows first (HF's gate_up_proj, as its converter
# copies it); it has no ffn_gate
_ARCH_LAYER_NAME_MAP = {
    "gemma2": _GEMMA_LAYER_NAME_MAP,
    "gemma3": _GEMMA_LAYER_NAME_MAP,
    "phi3": {**_LAYER_NAME_MAP, "ffn_up": "mlp.gate_up_proj"},
}
# A fused tensor's HF stem -> its parts, in row order; each part's rows are its shape's
# (ModelArchConfig.weight_shapes), so the split follows the config
_FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Tensors that are metadata: RoPE's per-frequency divisors, read into the config
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# The token that ends a chat turn where the GGUF does not list it as EOS (llama.cpp finds it
# by its text)
_END_OF_TURN = {"gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>", "phi3": "<|end|>"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Mixtral GGUFs written before the 3-D expert tensors: one 2-D tensor per expert
_OLD_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# Types the reader already hands back as plain numpy dtypes that `dequantize` does not cover.
_PLAIN_TYPES = {
    gguf.GGMLQuantizationType.F64,
    gguf.GGMLQuantizationType.I8,
    gguf.GGMLQuantizationType.I16,
    gguf.GGMLQuantizationType.I32,
    gguf.GGMLQuantizationType.I64,
}


# what a load is asked for: --quantization once "auto" is resolved (loader.weight_quantization)
RESOLVED_QUANTIZATIONS = ("none", "gguf", "gguf_int8")


def load_gguf(
    path: str, quantization: str = "none", plan: ShardPlan | None = None
) -> tuple[ModelArchConfig, dict[str, torch.Tensor | QuantizedTensor]]:
    """Config from the GGUF metadata and HF-named, HF-laid-out weights: float32 tensors, and with
    quantization="gguf" `QuantizedTensor`s for the weights a quantized kernel serves. With a
    tensor-parallel `plan`, each tensor is cut to the rank's slice as it is read, so no more
    than one whole tensor is ever held."""
    if quantization not in RESOLVED_QUANTIZATIONS:
        raise ValueError(
            f"--quantization must be one of {', '.join(RESOLVED_QUANTIZATIONS)}, "
            f"got {quantization!r}"
        )
    reader = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    config = _config_of(reader, path, tensors)
    arch = _field(reader, "general.architecture")
    _, permuted = GGUF_ARCHITECTURES[arch]
    gemma = config.traits.gemma_norms
    shapes = config.weight_shapes()

    weights: dict[str, torch.Tensor | QuantizedTensor] = {}
    for gguf_name, tensor in tensors.items():
        if gguf_name in _ROPE_TENSORS:
            continue  # read into the config
        name = _hf_name(gguf_name, arch)
        if name is None:
            logger.warning("%s: ignoring tensor %s", path, gguf_name)
            continue
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if plan is not None and not plan.holds(name):
            continue  # another rank's expert (one tensor per expert): never read
        if name.endswith(".mlp.experts"):
            for part, array in _split_experts(tensor, name, quantization).items():
                if plan is not None and not plan.holds(part):
                    continue  # another rank's expert (--enable-expert-parallel)
                weights[part] = _to_weight(array if plan is None else plan.shard(part, array))
            continue
        int8 = quantization == "gguf_int8"
        keep = quantization != "none" and _kernel_serves(tensor, int8)
        array = _keep_quantized(tensor, int8) if keep else dequantize_tensor(tensor)
        if gemma and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norms as (1 + w); HF's weights are w
            array = np.asarray(array) - 1.0
        if name.endswith(".shared_expert_gate.weight") and not isinstance(array, QuantizedTensor):
            array = np.asarray(array).reshape(1, -1)
        if permuted and (".q_proj." in name or ".k_proj." in name):
            num_heads = (
                config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            )
            array = _unpermute(array, num_heads)
        for part, rows in _split_fused(path, name, array, shapes).items():
            if plan is not None:
                rows = plan.shard(part, rows)
            weights[part] = _to_weight(rows)
    return config, weights


def _split_fused(
    path: str, name: str, array: np.ndarray | QuantizedTensor, shapes: dict[str, tuple[int, ...]]
) -> dict[str, np.ndarray | QuantizedTensor]:
    """A fused tensor (`_FUSED_PARTS`) cut by rows into its HF parts, `{name: array}` for any
    other. Quantized rows keep their blocks (a block never spans two rows). The model fuses the
    parts again; the sharding plan and the shape checks speak of the parts."""
    fused = next((f for f in _FUSED_PARTS if f".{f}." in name), None)
    if fused is None:
        return {name: array}
    prefix, leaf = name.split(f".{fused}.")  # model.layers.{i}, weight
    names = [f"{prefix}.{part}.{leaf}" for part in _FUSED_PARTS[fused]]
    if any(n not in shapes for n in names):
        return {name: array}  # a tensor the config has no place for (check_weights names it)
    sizes = [shapes[n][0] for n in names]
    if array.shape[0] != sum(sizes):
        raise ValueError(f"{path}: {name} has {array.shape[0]} rows, expected "
                         f"{' + '.join(map(str, sizes))} ({', '.join(names)})")
    out: dict[str, np.ndarray | QuantizedTensor] = {}
    start = 0
    for part_name, size in zip(names, sizes, strict=True):
        if isinstance(array, QuantizedTensor):
            k = array.shape[1]
            data = np.ascontiguousarray(array.data[start:start + size])
            out[part_name] = array.with_data(data, torch.Size([size, k]))
        else:
            out[part_name] = np.ascontiguousarray(array[start:start + size])
        start += size
    return out


def _to_weight(array) -> torch.Tensor | QuantizedTensor:
    if isinstance(array, QuantizedTensor | torch.Tensor):
        return array
    return torch.from_numpy(np.ascontiguousarray(array))


def _split_experts(
    tensor: gguf.ReaderTensor, stem: str, quantization: str
) -> dict[str, np.ndarray | QuantizedTensor]:
    """One 3-D expert tensor [E, out, in] -> each expert's 2-D weight under its HF name
    (`{stem}.{e}.{proj}.weight`). Blocks a kernel serves stay quantized, one slice of rows per
    expert, so a step reads only the experts its tokens chose (and a rank can hold a subset)."""
    proj = _EXPERT_NAME_MAP[tensor.name.split(".")[2]]
    num_experts, n, k = (int(d) for d in reversed(tensor.shape))
    int8 = quantization == "gguf_int8"
    names = [f"{stem}.{e}.{proj}.weight" for e in range(num_experts)]
    if quantization != "none" and tensor.tensor_type in (INT8_FORMATS if int8 else KERNEL_FORMATS):
        data = np.asarray(tensor.data).reshape(num_experts, n, -1)  # [E, rows, bytes a row]
        return {
            name: QuantizedTensor(tensor.tensor_type, np.array(data[e], copy=True),
                                  torch.Size([n, k]), int8)
            for e, name in enumerate(names)
        }
    dense = dequantize_tensor(tensor)  # [E, n, k]
    return {name: dense[e] for e, name in enumerate(names)}


def read_gguf_config(path: str) -> ModelArchConfig:
    """The architecture alone (metadata and tensor shapes; no weight is read)."""
    reader = _open(path)
    return _config_of(reader, path, {t.name: t for t in reader.tensors})


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    return gguf.GGUFReader(path, "r")


# Weight types of at most 6 bits: their own rounding (a 16th to a 64th of a block's range) is 8-30x
# that of activations rounded to 8-bit blocks (a 254th), so the integer path adds little to it
_LOW_BIT_TYPES = {
    gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1,
    gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.Q3_K,
    gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
    gguf.GGMLQuantizationType.Q6_K,
}


def low_bit_weight_share(path: str) -> float:
    """The share of the file's matrix parameters stored in types of at most 6 bits (Q4_0 ...
    Q6_K), against 8-bit, 16-bit and float matrices: what `--quantization auto` asks of a GGUF
    before it runs it on 8-bit activations."""
    low = total = 0
    for t in _open(path).tensors:
        if len(t.shape) < 2:
            continue  # norms and biases
        n = int(t.n_elements)
        total += n
        low += n if t.tensor_type in _LOW_BIT_TYPES else 0
    return low / total if total else 0.0


def _open(path: str) -> gguf.GGUFReader:
    """A reader of the file, parsed once per process: gguf parses every vocabulary entry in
    Python (seconds for Gemma's 262k tokens), and loading reads the config more than once. The
    reader maps the file read-only; the weights are copied out of it."""
    st = os.stat(path)
    return _open_cached(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def _config_of(reader: gguf.GGUFReader, path: str, tensors: dict) -> ModelArchConfig:
    rope = {name.removesuffix(".weight"): dequantize_tensor(tensors[name]).reshape(-1)
            for name in _ROPE_TENSORS if name in tensors}
    shapes = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in tensors.items()}
    return _read_config(reader, path, shapes, rope)


def dequantize_tensor(tensor: gguf.ReaderTensor) -> np.ndarray:
    """One GGUF tensor as a writable float32 array in numpy order (GGUF's shape reversed)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dim first
    if tensor.tensor_type in _PLAIN_TYPES:
        array = np.asarray(tensor.data, dtype=np.float32)
    else:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # F32 comes back as a view of the read-only memmap: copy so torch owns writable memory.
    array = np.array(array, dtype=np.float32, copy=True)
    return array.reshape(shape)


def _kernel_serves(tensor: gguf.ReaderTensor, int8: bool = False) -> bool:
    formats = INT8_FORMATS if int8 else KERNEL_FORMATS
    return tensor.tensor_type in formats and len(tensor.shape) == 2


def _keep_quantized(tensor: gguf.ReaderTensor, int8: bool = False) -> QuantizedTensor:
    """The tensor's blocks, copied out of the file's mmap (so the mapping closes after loading)."""
    shape = torch.Size(int(d) for d in reversed(tensor.shape))
    return QuantizedTensor(tensor.tensor_type, np.array(tensor.data, copy=True), shape, int8)


def _unpermute(w: np.ndarray | QuantizedTensor, num_heads: int) -> np.ndarray | QuantizedTensor:
    """`_unpermute_rows` on float rows or on rows of blocks (a row's blocks move with it)."""
    if isinstance(w, QuantizedTensor):
        rows = _unpermute_rows(w.data, num_heads)
        return w.with_data(np.ascontiguousarray(rows), w.shape)
    return _unpermute_rows(w, num_heads)


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K permutation: within each head, rows were stored as interleaved
    pairs (j, j + head_dim/2) -> (2j, 2j+1); regroup them into the two halves HF expects."""
    head_dim = w.shape[0] // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor; a 3-D expert tensor gives the stem of its experts
    (`model.layers.{i}.mlp.experts`, split by `_split_experts`)."""
    old = _OLD_EXPERT_RE.fullmatch(gguf_name)
    if old:
        layer, proj, expert = old.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
    m = _LAYER_RE.fullmatch(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part in _EXPERT_NAME_MAP and kind == "weight":
            return f"model.layers.{layer}.mlp.experts"
        hf = _ARCH_LAYER_NAME_MAP.get(arch, _LAYER_NAME_MAP).get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    hf = _NAME_MAP.get(base)
    return None if hf is None or kind != "weight" else f"{hf}.{kind}"


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _read_config(
    reader: gguf.GGUFReader,
    path: str,
    shapes: dict[str, tuple[int, ...]],
    rope: dict[str, np.ndarray],
) -> ModelArchConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    architecture, _ = GGUF_ARCHITECTURES[arch]
    num_experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if arch == "llama" and num_experts:
        architecture = GGUF_LLAMA_WITH_EXPERTS
    if num_experts and not traits(architecture).moe:
        raise ValueError(f"{path}: GGUF architecture {arch!r} with {arch}.expert_count "
                         f"{num_experts} is not supported")

    def key(name: str, default=None):
        value = _field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    # llama.cpp: a head is key_length wide (else hidden / heads) and RoPE rotates
    # rope.dimension_count of its dims (fewer under Phi-4-mini's partial rotary factor)
    head_dim = int(_field(reader, f"{arch}.attention.key_length", 0) or hidden_size // num_heads)
    rotary_dim = int(_field(reader, f"{arch}.rope.dimension_count", 0) or head_dim)
    if rotary_dim > head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count ({rotary_dim}) is larger than "
                         f"a head ({head_dim} dims)")
    rope_theta = float(key("rope.freq_base", 10000.0))
    eos_ids: list[int] = []
    for tok_key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tok = _field(reader, f"tokenizer.ggml.{tok_key}")
        if tok is not None and int(tok) not in eos_ids:
            eos_ids.append(int(tok))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")

    # The embedding's rows are the model's vocabulary (it may be padded past the token list).
    vocab_size = int(shapes["token_embd.weight"][0])
    num_layers = int(key("block_count"))
    family = traits(architecture)
    # 0: none (llama.cpp's phi3 converter writes 0 for a model without a window)
    window = _field(reader, f"{arch}.attention.sliding_window") or None
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
    width = _field(reader, f"{arch}.expert_feed_forward_length")
    if width is None:  # the experts' own rows (3-D tensors, or one tensor per expert)
        width = (shapes["blk.0.ffn_gate_exps.weight"][1] if "blk.0.ffn_gate_exps.weight" in shapes
                 else shapes["blk.0.ffn_gate.0.weight"][0])
    norm = _field(reader, f"{arch}.expert_weights_norm")
    shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared is None and "blk.0.ffn_gate_shexp.weight" in shapes:
        shared = shapes["blk.0.ffn_gate_shexp.weight"][0]
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count", 0) or 0),
        moe_intermediate_size=int(width),
        norm_topk_prob=_RENORMALIZED.get(arch, True) if norm is None else bool(norm),
        shared_expert_intermediate_size=int(shared or 0),
    )


def _optional_float(reader: gguf.GGUFReader, key: str) -> float | None:
    value = _field(reader, key)
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
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
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
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
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
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
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
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
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
