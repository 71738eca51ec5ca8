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
Metadata -> config (RoPE scaling from Llama 3.x's `rope_freqs.weight` and Phi-3's LongRoPE
factor tensors among it): gguf_config.py.
"""

from __future__ import annotations

import functools
import logging
import os
import re

import gguf
import numpy as np
import torch

from tessera.distributed.sharding import ShardPlan
from tessera.model.config import ModelArchConfig
from tessera.model.gguf_config import (  # noqa: F401  (the rope helpers: imported from here too)
    llama3_rope_factors,
    llama3_rope_scaling_from_factors,
    read_config,
    read_field,
)
from tessera.model.gguf_quant import INT8_FORMATS, INTEGER_PATHS, KERNEL_FORMATS, QuantizedTensor
from tessera.model.registry import GGUF_ARCHITECTURES

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
RESOLVED_QUANTIZATIONS = ("none", "gguf", *INTEGER_PATHS)


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
    arch = read_field(reader, "general.architecture")
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
        planes = INTEGER_PATHS.get(quantization, 0)
        keep = quantization != "none" and _kernel_serves(tensor, planes > 0)
        array = _keep_quantized(tensor, planes) if keep else dequantize_tensor(tensor)
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
    planes = INTEGER_PATHS.get(quantization, 0)
    names = [f"{stem}.{e}.{proj}.weight" for e in range(num_experts)]
    formats = INT8_FORMATS if planes else KERNEL_FORMATS
    if quantization != "none" and tensor.tensor_type in formats:
        data = np.asarray(tensor.data).reshape(num_experts, n, -1)  # [E, rows, bytes a row]
        return {
            name: QuantizedTensor(tensor.tensor_type, np.array(data[e], copy=True),
                                  torch.Size([n, k]), planes > 0, max(planes, 1))
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


def integer_path_share(path: str) -> float:
    """The share of the file's matrix parameters stored in types the integer path keeps in their
    blocks (gguf_quant.INT8_FORMATS: Q4_0 ... Q8_0, Q4_K ... Q6_K), against float matrices and
    types dequantized at load: what `--quantization auto` asks of a GGUF before it runs it on
    8-bit activations."""
    kept = total = 0
    for t in _open(path).tensors:
        if len(t.shape) < 2:
            continue  # norms and biases
        n = int(t.n_elements)
        total += n
        kept += n if t.tensor_type in INT8_FORMATS else 0
    return kept / total if total else 0.0


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
    return read_config(reader, path, shapes, rope)


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


def _keep_quantized(tensor: gguf.ReaderTensor, planes: int = 0) -> QuantizedTensor:
    """The tensor's blocks, copied out of the file's mmap (so the mapping closes after loading),
    for the exact kernels (planes 0) or the integer path with `planes` activation planes."""
    shape = torch.Size(int(d) for d in reversed(tensor.shape))
    data = np.array(tensor.data, copy=True)
    return QuantizedTensor(tensor.tensor_type, data, shape, planes > 0, max(planes, 1))


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
