"""The numbers a roofline needs, from package data: hardware specs (data/hardware.json, each with
its source) and model architectures (data/models/NAME/config.json, Hugging Face's config format,
written from the published architecture numbers; or any config.json path).

`ModelSpec` derives, from a config.json, what a step of that model costs in the abstract: FLOPs
per token of the linear layers, FLOPs per attended (query, key) pair, weight bytes read per step
and KV bytes per token. Torch-free, like the rest of the simulator's planning path.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from dataclasses import dataclass

from tessera.utils import hf_windows, kv_bytes_per_token

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _data():
    return importlib.resources.files("tessera.simulator").joinpath("data")


def hardware_names() -> list[str]:
    return sorted(
        k for k in json.loads(_data().joinpath("hardware.json").read_text()) if k[0] != "_"
    )


def model_config_names() -> list[str]:
    return sorted(p.name for p in _data().joinpath("models").iterdir() if p.is_dir())


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_flops: dict[str, float]  # dense matmul FLOP/s by dtype
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    host_bandwidth: float  # bytes/s one way: what swap traffic crosses
    compute_efficiency: float
    memory_efficiency: float
    step_overhead_s: float
    source: str
    tp_link: dict | None = None  # tensor parallelism's all-reduces (parallel.py)
    kv_link: dict | None = None  # disaggregation's KV pulls between instances

    def link(self, kind: str):
        """`tp_link` or `kv_link` as a parallel.LinkSpec; ValueError if the spec has none."""
        from tessera.simulator.parallel import parse_link

        spec = getattr(self, kind)
        if spec is None:
            raise ValueError(f"--hardware {self.name} has no {kind} in its spec")
        link = parse_link(spec, f"--hardware {self.name} {kind}")
        assert link is not None
        return link

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"--dtype {dtype} has no peak FLOP/s for --hardware {self.name} "
                             f"(known: {', '.join(self.peak_flops)})")
        return self.peak_flops[dtype]


def load_hardware(name: str) -> HardwareSpec:
    """A shipped spec by name (`--hardware`); ValueError listing the names otherwise."""
    specs = json.loads(_data().joinpath("hardware.json").read_text())
    if name not in specs or name.startswith("_"):
        raise ValueError(f"--hardware {name!r} is unknown; one of {', '.join(hardware_names())}")
    return HardwareSpec(name=name, **specs[name])


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (Llama / Qwen2 layout: GQA attention, gated MLP)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None  # the checkpoint's dtype, which `--dtype auto` simulates
    # the window every layer attends within (Mistral): the scheduler releases the blocks behind
    # it, as the engine does; None with no window or with local and global layers mixed
    sliding_window: int | None = None
    # each layer's window when local and global layers are mixed (Gemma 2/3): the KV cache is
    # split into groups, priced and released per group as the engine does; () otherwise
    layer_windows: tuple[int | None, ...] = ()

    @property
    def linear_params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o; k, v
        return attn + 3 * h * self.intermediate_size  # gate, up, down

    @property
    def num_params(self) -> int:
        """All weights (embedding and, unless tied, the LM head included)."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * self.linear_params_per_layer + embed + head

    @property
    def linear_flops_per_token(self) -> int:
        """Multiply-adds of every layer's linears, times 2 (the LM head is per sampled token)."""
        return 2 * self.num_layers * self.linear_params_per_layer

    @property
    def lm_head_flops(self) -> int:
        return 2 * self.vocab_size * self.hidden_size

    @property
    def attention_flops_per_pair(self) -> int:
        """QK^T and PV for one query token against one cached token, all heads and layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def weight_bytes_per_step(self, dtype: str) -> int:
        """Weights one forward pass streams: every linear and the LM head (the embedding is
        gathered by row, not read whole)."""
        params = self.num_layers * self.linear_params_per_layer + self.vocab_size * self.hidden_size
        return params * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                  DTYPE_BYTES[dtype])


def _stored_dtype(config: dict) -> str | None:
    """config.json's `torch_dtype` (transformers v4) or `dtype` (v5), if one we can simulate."""
    stored = str(config.get("torch_dtype") or config.get("dtype") or "").removeprefix("torch.")
    return stored if stored in DTYPE_BYTES else None


def _windows(config: dict) -> tuple[int | None, tuple[int | None, ...]]:
    """(the window of every layer, or None; each layer's window when they differ, or ()) from
    config.json, by the loader's rule (`tessera.utils.hf_windows`)."""
    if config.get("use_sliding_window") is False:
        return None, ()
    architecture = (config.get("architectures") or [""])[0]
    window, types = hf_windows(config, architecture, config["num_hidden_layers"])
    if window is None:
        return None, ()
    if all(t == "sliding_attention" for t in types):
        return window, ()
    return None, tuple(window if t == "sliding_attention" else None for t in types)


def load_model_config(name_or_path: str) -> ModelSpec:
    """`--model-config`: a shipped name (Llama-3-8B, ...), a config.json path or a directory
    holding one."""
    if os.path.exists(name_or_path):
        path = name_or_path
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    elif name_or_path in model_config_names():
        text = _data().joinpath("models", name_or_path, "config.json").read_text()
        config, name = json.loads(text), name_or_path
    else:
        raise ValueError(f"--model-config {name_or_path!r} is neither a config.json nor one of "
                         f"{', '.join(model_config_names())}")
    try:
        heads = config["num_attention_heads"]
        window, layer_windows = _windows(config)
        return ModelSpec(
            name=name,
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            torch_dtype=_stored_dtype(config),
            sliding_window=window,
            layer_windows=layer_windows,
        )
    except KeyError as e:
        raise ValueError(
            f"--model-config {name_or_path}: config.json lacks {e.args[0]!r}"
        ) from None
