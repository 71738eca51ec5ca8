"""The numbers a roofline needs, from package data: hardware specs (data/hardware.json, each with
its source) and model architectures (data/models/NAME/config.json, Hugging Face's config format,
written from the published architecture numbers; or any config.json path).

`ModelSpec` derives, from a config.json, what a step of that model costs in the abstract: FLOPs
per token of the linear layers, FLOPs per attended (query, key) pair, weight bytes read per step
and KV bytes per token. Torch-free, like the rest of the simulator's planning path.

A mixture of experts (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE) prices by what a step touches:

    FLOPs per token   attention + router + shared expert + k experts (the active parameters)
    weights per step  attention + router + shared expert + the experts the step's tokens chose
    experts chosen    E (1 - (1 - k/E)^B) for B tokens routed top-k over E experts

The last line is the expected number of distinct experts B independent top-k choices hit when
every expert is equally likely (each token misses a given expert with probability 1 - k/E):
k at B = 1, all E as B grows. Real routers are skewed, which touches fewer; the formula is the
balanced router's upper bound that the load-balancing loss trains towards.
"""

from __future__ import annotations

import importlib.resources
import json
import math
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


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Distinct experts that `num_tokens` tokens, each routed to `top_k` of `num_experts` experts
    chosen evenly, touch on average: E (1 - (1 - k/E)^B), never above min(E, B k)."""
    e, k, b = num_experts, top_k, num_tokens
    if not 1 <= k <= e:
        raise ValueError(f"num_experts_per_tok ({k}) must be between 1 and num_experts ({e})")
    if b < 0:
        raise ValueError(f"num_tokens ({b}) must be >= 0")
    if b == 0:
        return 0.0
    if k == e:
        return float(e)
    # 1 - (1 - p)^B as -expm1(B log1p(-p)): exact for small p, where (1 - p)^B rounds badly
    touched = -e * math.expm1(b * math.log1p(-k / e))
    return min(float(e), float(b * k), touched)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (Llama / Qwen2 layout: GQA attention, gated MLP), optionally
    with a mixture of experts in place of the MLP on `num_moe_layers` of its layers."""

    name: str
    hidden_size: int
    intermediate_size: int  # a dense layer's MLP width
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None  # the checkpoint's dtype, which `--dtype auto` simulates
    # config.json's `architectures[0]` ("" if it names none): the engine's refusals by family
    architecture: str = ""
    # the window every layer attends within (Mistral): the scheduler releases the blocks behind
    # it, as the engine does; None with no window or with local and global layers mixed
    sliding_window: int | None = None
    # each layer's window when local and global layers are mixed (Gemma 2/3): the KV cache is
    # split into groups, priced and released per group as the engine does; () otherwise
    layer_windows: tuple[int | None, ...] = ()
    # mixture of experts: 0 experts is a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's gated-MLP width
    shared_expert_intermediate_size: int = 0  # an always-on expert beside the routed ones
    num_moe_layers: int = 0  # layers whose MLP is the experts; the others are dense

    def __post_init__(self) -> None:
        if self.num_experts == 0:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be "
                             f"between 1 and num_experts ({self.num_experts})")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be > 0 with {self.num_experts} "
                             "experts")
        if not 0 <= self.num_moe_layers <= self.num_layers:
            raise ValueError(f"num_moe_layers ({self.num_moe_layers}) must be between 0 and "
                             f"num_hidden_layers ({self.num_layers})")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.num_moe_layers > 0

    @property
    def attention_params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        return h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o; k, v

    @property
    def linear_params_per_layer(self) -> int:
        """A dense layer's linears: attention and the gated MLP (gate, up, down)."""
        return self.attention_params_per_layer + 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed expert's gate, up and down."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def moe_layer_fixed_params(self) -> int:
        """What every token of a MoE layer reads besides its experts: attention, the router
        (hidden x experts) and the shared expert with its one-output gate, if any."""
        h, shared = self.hidden_size, self.shared_expert_intermediate_size
        return (self.attention_params_per_layer + h * self.num_experts
                + (3 * h * shared + h if shared else 0))

    def _linear_params(self, experts_per_moe_layer: float) -> float:
        """Every layer's linears with `experts_per_moe_layer` experts counted in each MoE
        layer."""
        moe = self.num_moe_layers if self.is_moe else 0
        dense = (self.num_layers - moe) * self.linear_params_per_layer
        return dense + moe * (self.moe_layer_fixed_params
                              + experts_per_moe_layer * self.expert_params)

    @property
    def num_params(self) -> int:
        """All weights (embedding and, unless tied, the LM head included; every expert)."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return int(self._linear_params(self.num_experts)) + embed + head

    @property
    def num_active_params(self) -> int:
        """The weights one token uses (its k experts; embedding and head included, as model
        cards count "activated" parameters). `num_params` for a dense model."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return int(self._linear_params(self.num_experts_per_tok)) + embed + head

    @property
    def linear_flops_per_token(self) -> int:
        """Multiply-adds of every layer's linears a token runs (its k experts), times 2 (the
        LM head is per sampled token)."""
        return int(2 * self._linear_params(self.num_experts_per_tok))

    @property
    def lm_head_flops(self) -> int:
        return 2 * self.vocab_size * self.hidden_size

    @property
    def attention_flops_per_pair(self) -> int:
        """QK^T and PV for one query token against one cached token, all heads and layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def experts_touched(self, num_tokens: int | None) -> float:
        """Experts a MoE layer reads in a step of `num_tokens` tokens (None: all of them)."""
        if num_tokens is None:
            return float(self.num_experts)
        return expected_experts_touched(self.num_experts, self.num_experts_per_tok, num_tokens)

    def weight_bytes_per_step(self, dtype: str, num_tokens: int | None = None) -> float:
        """Weights one forward pass of `num_tokens` tokens streams: every linear, the experts
        its tokens chose (all of them with `num_tokens` None) and the LM head (the embedding is
        gathered by row, not read whole)."""
        experts = self.experts_touched(num_tokens) if self.is_moe else 0.0
        params = self._linear_params(experts) + self.vocab_size * self.hidden_size
        return params * DTYPE_BYTES[dtype]

    def expert_bytes_per_step(self, dtype: str, num_tokens: int | None = None) -> float:
        """The part of `weight_bytes_per_step` that is routed experts (0 for a dense model)."""
        if not self.is_moe:
            return 0.0
        experts = self.num_moe_layers * self.experts_touched(num_tokens) * self.expert_params
        return experts * DTYPE_BYTES[dtype]

    @property
    def dense_intermediate_size(self) -> int | None:
        """The dense MLP's width, None when every layer is MoE (nothing dense to shard)."""
        return None if self.is_moe and self.num_moe_layers == self.num_layers \
            else self.intermediate_size

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


def _moe_fields(config: dict) -> dict:
    """The expert fields of a MoE config.json, by Hugging Face's names: `num_experts` (Qwen-MoE,
    OLMoE) or `num_local_experts` (Mixtral), `num_experts_per_tok`, the expert width
    `moe_intermediate_size` (else `intermediate_size`, Mixtral's and OLMoE's), Qwen's
    `decoder_sparse_step` and `mlp_only_layers` (which layers keep a dense MLP) and
    `shared_expert_intermediate_size` (Qwen2-MoE). {} for a dense model."""
    if config.get("n_routed_experts"):
        raise ValueError("DeepSeek-style experts (n_routed_experts) are not modelled; give a "
                         "config with num_experts or num_local_experts")
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if num_experts == 0:
        return {}
    num_layers = config["num_hidden_layers"]
    step = int(config.get("decoder_sparse_step") or 1)
    dense_layers = set(config.get("mlp_only_layers") or [])
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(config["num_experts_per_tok"]),
        "moe_intermediate_size": int(config.get("moe_intermediate_size")
                                     or config["intermediate_size"]),
        "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size")
                                               or 0),
        "num_moe_layers": sum(1 for i in range(num_layers)
                              if i not in dense_layers and (i + 1) % step == 0),
    }


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
            architecture=(config.get("architectures") or [""])[0],
            sliding_window=window,
            layer_windows=layer_windows,
            **_moe_fields(config),
        )
    except KeyError as e:
        raise ValueError(
            f"--model-config {name_or_path}: config.json lacks {e.args[0]!r}"
        ) from None
    except ValueError as e:
        raise ValueError(f"--model-config {name_or_path}: {e}") from None
