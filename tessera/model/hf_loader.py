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
import re

import torch
from safetensors import safe_open

from tessera.distributed.sharding import ShardPlan
from tessera.model.config import ModelArchConfig
from tessera.model.registry import hf_architecture, supported_architectures, traits
from tessera.utils import hf_windows

logger = logging.getLogger(__name__)


def load_hf_dir(
    path: str, plan: ShardPlan | None = None
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """Config from `config.json` (+ `generation_config.json` for extra EOS ids) and float32
    weights from every `*.safetensors` file in the directory. With a tensor-parallel `plan`, only
    the rank's slice of each tensor is read from the file (safetensors slices), and under expert
    parallelism only the rank's experts."""
    files = _safetensors_files(path)
    names = {name for file in files for name in _keys(file)}
    config = read_hf_config(path, has_lm_head="lm_head.weight" in names)
    expected = set(config.weight_names())
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if stored.endswith((".qkv_proj.weight", ".gate_up_proj.weight",
                                    ".experts.gate_up_proj", ".experts.down_proj")):
                    for part, t in _split_fused(config, stored, f.get_tensor(stored)).items():
                        if plan is not None and not plan.holds(part):
                            continue  # another rank's expert (--enable-expert-parallel)
                        weights[part] = (t if plan is None else plan.shard(part, t)).to(
                            torch.float32).contiguous()
                    continue
                name = _canonical_name(stored)
                if name not in expected:
                    if name != "lm_head.weight":  # a tied checkpoint may still store a copy
                        logger.warning("%s: ignoring tensor %s", path, name)
                    continue
                if plan is not None and not plan.holds(name):
                    continue  # another rank's expert: never read
                cut = None if plan is None else plan.slice_of(name)
                if cut is None or (cut[0] == 1 and len(f.get_slice(stored).get_shape()) == 1):
                    tensor = f.get_tensor(stored)
                else:
                    dim, start, stop = cut
                    sl = f.get_slice(stored)
                    tensor = sl[start:stop] if dim == 0 else sl[:, start:stop]
                weights[name] = tensor.to(torch.float32).contiguous()
    return config, weights


# Mixtral's names for its MoE block -> the names the model code reads (Qwen3-MoE's and OLMoE's)
_MIXTRAL_RE = re.compile(r"(.*)\.block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _canonical_name(name: str) -> str:
    """A checkpoint's tensor name as the model code reads it."""
    m = _MIXTRAL_RE.fullmatch(name)
    if m is None:
        return name
    stem, leaf = m.groups()
    if leaf == "gate":
        return f"{stem}.mlp.gate.weight"
    _, expert, proj = leaf.split(".")
    return f"{stem}.mlp.experts.{expert}.{_MIXTRAL_PROJ[proj]}.weight"


def _split_fused(config: ModelArchConfig, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Phi-3 stores q|k|v as `qkv_proj` and gate|up as `gate_up_proj`; transformers' own MoE
    layout stores every expert of a layer in `experts.gate_up_proj` [E, 2I, H] and
    `experts.down_proj` [E, H, I]. The model fuses them again itself, but the sharding plan and
    the shape checks speak of the parts (one expert each)."""
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        stem = name.rsplit(".", 1)[0].replace(".block_sparse_moe.", ".mlp.")
        out: dict[str, torch.Tensor] = {}
        for e in range(t.shape[0]):
            if name.endswith(".down_proj"):
                out[f"{stem}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2)
                out[f"{stem}.{e}.gate_proj.weight"] = gate
                out[f"{stem}.{e}.up_proj.weight"] = up
        return out
    prefix = name.rsplit(".", 2)[0]
    if name.endswith(".qkv_proj.weight"):
        q, k, v = t.split([config.q_size, config.kv_size, config.kv_size])
        stem = prefix.removesuffix(".qkv_proj")
        return {f"{stem}.q_proj.weight": q, f"{stem}.k_proj.weight": k,
                f"{stem}.v_proj.weight": v}
    gate, up = t.split([config.intermediate_size, config.intermediate_size])
    stem = prefix.removesuffix(".gate_up_proj")
    return {f"{stem}.gate_proj.weight": gate, f"{stem}.up_proj.weight": up}


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
    """`ModelArchConfig` from an HF directory's config.json (transformers v4 or v5 layout).
    A field the engine cannot honour is refused here, by name."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    hf_arch = next((a for a in archs if hf_architecture(a) is not None), None)
    if hf_arch is None:
        raise ValueError(
            f"{path}: architectures {archs} are not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    architecture = hf_architecture(hf_arch)
    assert architecture is not None
    family = traits(architecture)
    num_layers = int(cfg["num_hidden_layers"])
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    rope_theta, rope_scaling, local_theta, partial = _rope_of(cfg, path, max_pos)
    sliding, layer_types = hf_windows(cfg, architecture, num_layers)

    if not family.qkv_bias and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ValueError(f"{path}: attention_bias/mlp_bias is not supported for {architecture}")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or family.activation
    if _ACTIVATIONS.get(act) != family.activation:
        raise ValueError(
            f"{path}: hidden_act {act!r} is not supported for {architecture} "
            f"(it uses {family.activation})"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{path}: use_bidirectional_attention is not supported (causal only)")

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
        attention_bias=family.qkv_bias,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        sliding_window=sliding,
        layer_types=layer_types,
        rope_local_base_freq=local_theta,
        query_pre_attn_scalar=_positive(cfg, "query_pre_attn_scalar")
        if family.gemma_norms
        else None,
        attn_logit_softcapping=_positive(cfg, "attn_logit_softcapping"),
        final_logit_softcapping=_positive(cfg, "final_logit_softcapping"),
        partial_rotary_factor=partial,
        **_moe_of(cfg, path, architecture),
    )


def _moe_of(cfg: dict, path: str, architecture: str) -> dict:
    """The `ModelArchConfig` fields of a mixture-of-experts config (none for a dense family).
    Names vary: Qwen3-MoE and OLMoE say num_experts (transformers v5 writes num_local_experts
    for Qwen3-MoE), Mixtral num_local_experts; OLMoE's and Mixtral's experts are
    intermediate_size wide, Qwen3-MoE's moe_intermediate_size."""
    family = traits(architecture)
    if not family.moe:
        return {}
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if num_experts is None:
        raise ValueError(f"{path}: config.json of {architecture} lacks num_experts")
    if cfg.get("num_experts_per_tok") is None:
        raise ValueError(f"{path}: config.json of {architecture} lacks num_experts_per_tok")
    fields = dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        norm_topk_prob=family.always_renormalize or bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        clip_qkv=None if cfg.get("clip_qkv") is None else float(cfg["clip_qkv"]),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )
    if fields["num_experts"] and not 1 <= fields["num_experts_per_tok"] <= fields["num_experts"]:
        raise ValueError(
            f"{path}: num_experts_per_tok ({fields['num_experts_per_tok']}) must be between 1 "
            f"and the number of experts ({fields['num_experts']})"
        )
    if fields["shared_expert_intermediate_size"] and architecture != "Qwen2MoeForCausalLM":
        raise ValueError(
            f"{path}: shared_expert_intermediate_size is not supported for {architecture} "
            "(it has no shared expert)"
        )
    if architecture == "Qwen2MoeForCausalLM" and cfg.get("use_sliding_window"):
        raise ValueError(f"{path}: use_sliding_window is not supported for {architecture}")
    return fields


# HF's activation names -> the gate the family computes
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "gelu_tanh": "gelu_pytorch_tanh",
}
# RoPE types the engine computes (tessera/model/layers.py rope_inv_freq); "su" is longrope's
# older name
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def _positive(cfg: dict, name: str) -> float | None:
    value = cfg.get(name)
    return None if value is None else float(value)


def _rope_of(cfg: dict, path: str, max_pos: int) -> tuple[float, dict | None, float | None, float]:
    """(rope_theta, rope_scaling, the local layers' theta, partial_rotary_factor). transformers v5
    writes `rope_parameters` ({rope_theta, rope_type, ...}, or one such dict per layer type for
    Gemma 3); v4 wrote rope_theta and rope_scaling (and Gemma 3 rope_local_base_freq)."""
    params = dict(cfg.get("rope_parameters") or {})
    local_theta = cfg.get("rope_local_base_freq")
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"{path}: rope_parameters.sliding_attention: only default RoPE "
                f"is supported on local layers, got {local.get('rope_type')!r}"
            )
        local_theta = local.get("rope_theta", local_theta)
        params = dict(params.get("full_attention") or {})
    rope_theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if cfg.get("rope_scaling"):
        params.update(cfg["rope_scaling"])
    if "type" in params:  # older spelling
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type") == "su":
        params["rope_type"] = "longrope"
    kind = params.get("rope_type", "default")
    if kind not in _ROPE_TYPES:
        raise ValueError(
            f"{path}: rope_scaling type {kind!r} is not supported; supported: "
            f"{', '.join(_ROPE_TYPES)}"
        )
    if kind in ("yarn", "longrope", "dynamic"):
        # Phi-3 keeps the pre-training length at the top level of config.json
        params.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings", max_pos),
        )
        params.setdefault("max_position_embeddings", max_pos)
    scaling = params if kind != "default" else None
    return rope_theta, scaling, None if local_theta is None else float(local_theta), partial
