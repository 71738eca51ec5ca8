"""Hugging Face checkpoint directories: `config.json` + `*.safetensors` (one file or shards).

Names and layout already match what the model code expects; this reads the config into a
`ModelArchConfig`, converts every tensor to float32 and drops what the model does not use
(e.g. old checkpoints' `rotary_emb.inv_freq` buffers, or a tied `lm_head.weight`).
"""

from __future__ import annotations

import glob
import json
import logging
import os

import torch
from safetensors import safe_open

from tessera.distributed.sharding import ShardPlan
from tessera.model.config import ModelArchConfig
from tessera.model.registry import (
    HF_ALIASES,
    has_qkv_bias,
    hf_architecture,
    supported_architectures,
)

logger = logging.getLogger(__name__)


def load_hf_dir(
    path: str, plan: ShardPlan | None = None
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """Config from `config.json` (+ `generation_config.json` for extra EOS ids) and float32
    weights from every `*.safetensors` file in the directory. With a tensor-parallel `plan`, only
    the rank's slice of each tensor is read from the file (safetensors slices)."""
    files = _safetensors_files(path)
    names = {name: file for file in files for name in _keys(file)}
    config = read_hf_config(path, has_lm_head="lm_head.weight" in names)
    expected = set(config.weight_names())
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name not in expected:
                    if name != "lm_head.weight":  # a tied checkpoint may still store a copy
                        logger.warning("%s: ignoring tensor %s", path, name)
                    continue
                cut = None if plan is None else plan.slice_of(name)
                if cut is None or (cut[0] == 1 and len(f.get_slice(name).get_shape()) == 1):
                    tensor = f.get_tensor(name)
                else:
                    dim, start, stop = cut
                    sl = f.get_slice(name)
                    tensor = sl[start:stop] if dim == 0 else sl[:, start:stop]
                weights[name] = tensor.to(torch.float32).contiguous()
    return config, weights


def read_hf_dir_config(path: str) -> ModelArchConfig:
    """The architecture alone (no tensor is read, only the safetensors headers)."""
    names = {name for file in _safetensors_files(path) for name in _keys(file)}
    return read_hf_config(path, has_lm_head="lm_head.weight" in names)


def _safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(
            f"{path}: no *.safetensors files (only safetensors checkpoints are supported)"
        )
    return files


def _keys(file: str) -> list[str]:
    with safe_open(file, framework="pt", device="cpu") as f:
        return list(f.keys())


def read_hf_config(path: str, has_lm_head: bool) -> ModelArchConfig:
    """`ModelArchConfig` from an HF directory's config.json (transformers v4 or v5 layout)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    hf_arch = next((a for a in archs if hf_architecture(a) is not None), None)
    if hf_arch is None:
        raise ValueError(
            f"{path}: architectures {archs} are not supported; supported: "
            f"{', '.join(supported_architectures())} "
            f"(and {', '.join(HF_ALIASES)} without sliding window)"
        )
    architecture = hf_architecture(hf_arch)
    assert architecture is not None
    sliding = cfg.get("sliding_window")
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    uses_sliding = cfg.get("use_sliding_window", hf_arch == "MistralForCausalLM")
    if uses_sliding and sliding is not None and sliding < max_pos:
        raise ValueError(f"{path}: sliding-window attention ({sliding}) is not supported")

    # transformers v5 writes rope_parameters {rope_theta, rope_type, ...}; v4 rope_theta and
    # rope_scaling.
    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if cfg.get("rope_scaling"):
        rope.update(cfg["rope_scaling"])
    if "type" in rope:  # older spelling
        rope.setdefault("rope_type", rope.pop("type"))
    rope_scaling = rope if rope.get("rope_type", "default") != "default" else None

    if not has_qkv_bias(architecture) and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ValueError(f"{path}: Llama with attention_bias/mlp_bias is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")

    num_heads = int(cfg["num_attention_heads"])
    tie = cfg.get("tie_word_embeddings")
    if tie is None:
        tie = not has_lm_head
    if not tie and not has_lm_head:
        raise ValueError(f"{path}: tie_word_embeddings is false but there is no lm_head.weight")

    eos_ids: list[int] = []
    gen_path = os.path.join(path, "generation_config.json")
    sources = [cfg.get("eos_token_id")]
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f).get("eos_token_id"))
    for src in sources:
        for tok in src if isinstance(src, list) else [src]:
            if tok is not None and int(tok) not in eos_ids:
                eos_ids.append(int(tok))

    return ModelArchConfig(
        architecture=architecture,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(tie),
        attention_bias=has_qkv_bias(architecture),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos_ids),
    )
