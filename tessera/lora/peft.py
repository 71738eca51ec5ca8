"""PEFT's LoRA format on disk, read and checked against the base model.

    ADAPTER_DIR/adapter_config.json       r, lora_alpha, use_rslora, target_modules, ...
    ADAPTER_DIR/adapter_model.safetensors base_model.model.model.layers.{i}.{self_attn|mlp}.
                                          {q,k,v,o,gate,up,down}_proj.lora_{A,B}.weight
                                          A: [r, in_features], B: [out_features, r]

The delta of a target is `x @ A^T @ B^T * scaling`, scaling = lora_alpha / r (lora_alpha / sqrt(r)
with use_rslora), as PEFT's `Linear.forward` computes it. `check_adapter` reads only the JSON and
the safetensors header (shapes), so the engine can refuse a bad adapter at load, naming the field,
before a worker reads any weights; `load_adapter` reads the weights (float32, on the CPU).

What PEFT can express and the engine does not serve is refused, not ignored: DoRA, biases,
fan_in_fan_out, per-module ranks or alphas (rank_pattern, alpha_pattern), modules_to_save (a full
copy of, e.g., the lm_head), targets other than the seven projections, ranks above --max-lora-rank.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class PeftLoRAConfig:
    """The fields of adapter_config.json the engine uses."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # the targets the weights file holds

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


@dataclass
class LoRAAdapter:
    """An adapter's weights as PEFT stores them: (layer, target) -> (A [r, in], B [out, r]),
    float32 on the CPU; targets an adapter leaves out of a layer are absent."""

    config: PeftLoRAConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def target_shapes(arch) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target projection of a Llama-family `arch`
    (tessera.model.config.ModelArchConfig), unsharded."""
    h, i = arch.hidden_size, arch.intermediate_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _fail(path: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {path}: {what}")


def read_config(path: str, max_lora_rank: int) -> dict:
    """adapter_config.json as a dict, with the fields the engine cannot serve refused."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise _fail(path, "lora_path is not a directory")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise _fail(path, f"lora_path holds no {CONFIG_FILE} (PEFT's format)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise _fail(path, f"{CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(path, f"{CONFIG_FILE} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _fail(path, f"peft_type is {peft_type}; only LORA is served")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(path, f"r must be an integer >= 1, got {r!r}")
    if r > max_lora_rank:
        raise _fail(path, f"r ({r}) is larger than --max-lora-rank ({max_lora_rank}); raise "
                          "--max-lora-rank")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _fail(path, f"lora_alpha must be a number, got {alpha!r}")
    unsupported = {"use_dora": False, "fan_in_fan_out": False, "bias": "none"}
    for key, ok in unsupported.items():
        if cfg.get(key, ok) not in (ok, None):
            raise _fail(path, f"{key} is {cfg[key]!r}; only {ok!r} is served")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layer_replication",
                "target_parameters"):
        if cfg.get(key):
            raise _fail(path, f"{key} is set ({cfg[key]!r}); adapters with it are not served")
    return cfg


def check_adapter(path: str, arch, max_lora_rank: int) -> PeftLoRAConfig:
    """Refuse (ValueError naming the field) an adapter the engine cannot serve over `arch`,
    reading only the config and the safetensors header."""
    from safetensors import safe_open

    cfg = read_config(path, max_lora_rank)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise _fail(path, f"lora_path holds no {WEIGHTS_FILE} (adapter_model.bin is not read: "
                          "save with safe_serialization=True)")
    shapes = target_shapes(arch)
    r = cfg["r"]
    found: set[tuple[int, str, str]] = set()
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                m = _KEY.search(key)
                if m is None:
                    raise _fail(path, f"target_modules: weight {key!r} is not a LoRA A/B of one of "
                                      f"{', '.join(TARGETS)}; only those targets are served")
                layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
                if target not in shapes:
                    raise _fail(path, f"target_modules: {target} is not served (targets: "
                                      f"{', '.join(TARGETS)})")
                if layer >= arch.num_hidden_layers:
                    raise _fail(path, f"weight {key!r} names layer {layer}; the base model has "
                                      f"{arch.num_hidden_layers}")
                out_f, in_f = shapes[target]
                want = (r, in_f) if ab == "A" else (out_f, r)
                got = tuple(f.get_slice(key).get_shape())
                if got != want:
                    raise _fail(path, f"weight {key!r} has shape {list(got)}, expected "
                                      f"{list(want)} for r {r} over this base model")
                found.add((layer, target, ab))
    except ValueError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise _fail(path, f"{WEIGHTS_FILE} cannot be read: {e}") from None
    pairs = {(layer, t) for layer, t, _ in found}
    for layer, target in pairs:
        if {(layer, target, "A"), (layer, target, "B")} - found:
            raise _fail(path, f"layer {layer} {target} has lora_A or lora_B but not both")
    if not pairs:
        raise _fail(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    targets = tuple(t for t in TARGETS if any(p[1] == t for p in pairs))
    return PeftLoRAConfig(r=r, lora_alpha=float(cfg.get("lora_alpha", 8)),
                          use_rslora=bool(cfg.get("use_rslora", False)), target_modules=targets)


def load_adapter(path: str, arch, max_lora_rank: int) -> LoRAAdapter:
    """Check, then read the adapter's weights (float32, CPU)."""
    from safetensors.torch import load_file

    config = check_adapter(path, arch, max_lora_rank)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE), device="cpu")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        m = _KEY.search(key)
        assert m is not None, "check_adapter accepted every key"
        if m.group(3) != "A":
            continue
        b = tensors[key[: -len("lora_A.weight")] + "lora_B.weight"]
        weights[(int(m.group(1)), m.group(2))] = (a.float(), b.float())
    return LoRAAdapter(config, weights)
