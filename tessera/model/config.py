"""The architecture of a loaded model: what the loaders read from GGUF metadata or `config.json`.

A plain frozen dataclass, shared by both loaders and the model code. It never reads files; the
loaders fill it in and `__post_init__` checks that the numbers are consistent.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.model.registry import ArchTraits, supported_architectures, traits

SUPPORTED_ARCHITECTURES = tuple(supported_architectures())  # the registry is their home


@dataclass(frozen=True)
class ModelArchConfig:
    """Shape and numerics of a decoder, in Hugging Face's vocabulary (the field names of its
    `config.json`). What is fixed by family (norm style, activation, q/k norm) is `traits`.

    `rope_scaling` is None or HF's dict form, e.g. `{"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}` or
    `{"rope_type": "linear", "factor": 2.0}`; "yarn", "longrope" and "dynamic" too.
    `attention_bias` is True for Qwen2 (bias on q/k/v).

    Sliding windows: `layer_types` names each layer "sliding_attention" or "full_attention" (HF's
    words); empty means every layer uses `sliding_window` if it is set (Mistral), else none. A
    query at position p attends to keys at positions (p - sliding_window, p].
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Gemma 3: the local (sliding) layers' own RoPE base; None = rope_theta
    rope_local_base_freq: float | None = None
    # Gemma: attention scale query_pre_attn_scalar**-0.5 instead of head_dim**-0.5
    query_pre_attn_scalar: float | None = None
    # Gemma 2: tanh soft-capping of attention scores and of the final logits
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Phi-4-mini: RoPE rotates only this fraction of each head
    partial_rotary_factor: float = 1.0
    # Mixture of experts (Qwen3-MoE, OLMoE, Mixtral); num_experts 0 is a dense model. A layer is
    # sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th one (Qwen3-MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's; intermediate_size is the dense layers'
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Qwen2-MoE: an MLP every token runs beside the routed experts, scaled by sigmoid(gate(x))
    shared_expert_intermediate_size: int = 0
    # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] after the projection (and q/k norms)
    clip_qkv: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ValueError(f"model config: rope_scaling lacks 'rope_type': {self.rope_scaling}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"model config: sliding_window must be >= 1, got {self.sliding_window}"
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"model config: layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            unknown = set(self.layer_types) - {"sliding_attention", "full_attention"}
            if unknown:
                raise ValueError(f"model config: layer_types {sorted(unknown)} are not supported")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError(
                    "model config: layer_types has sliding layers but no sliding_window"
                )
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(
                f"model config: partial_rotary_factor {self.partial_rotary_factor} does not give "
                f"an even number of rotary dims of head_dim {self.head_dim}"
            )
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"model config: {name} must be > 0, got {value}")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"model config: num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts == 0:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model config: num_experts_per_tok ({self.num_experts_per_tok}) must be between "
                f"1 and num_experts ({self.num_experts})"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(
                "model config: moe_intermediate_size must be >= 1, got "
                f"{self.moe_intermediate_size}"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(
                f"model config: decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}"
            )
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise ValueError(
                f"model config: mlp_only_layers {outside} are not layers of a "
                f"{self.num_hidden_layers}-layer model"
            )
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                "model config: shared_expert_intermediate_size must be >= 0, got "
                f"{self.shared_expert_intermediate_size}"
            )
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise ValueError(f"model config: clip_qkv must be > 0, got {self.clip_qkv}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` has a sparse MoE block in place of the MLP (HF's rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def traits(self) -> ArchTraits:
        """What the family changes in the decoder (tessera/model/registry.py)."""
        return traits(self.architecture)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer (keys (p - window, p] for a query at p), None for
        full attention."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        return self.sliding_window

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has the same one (its KV blocks can be released behind
        the window), else None."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer_window(i) for i in range(self.num_hidden_layers))

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        """Rows of q_proj: num_attention_heads * head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of k_proj (and of v_proj): num_key_value_heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

    def weight_names(self) -> list[str]:
        """The HF parameter names a loader returns for this config, in model order."""
        names = ["model.embed_tokens.weight"]
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            for proj in ("q_proj", "k_proj", "v_proj"):
                names.append(f"{p}self_attn.{proj}.weight")
                if self.attention_bias:
                    names.append(f"{p}self_attn.{proj}.bias")
            if self.traits.qk_norm:
                names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
            names.append(f"{p}self_attn.o_proj.weight")
            if self.is_moe_layer(i):  # the router, then each expert's MLP
                names.append(f"{p}mlp.gate.weight")
                names += [
                    f"{p}mlp.experts.{e}.{m}.weight"
                    for e in range(self.num_experts)
                    for m in ("gate_proj", "up_proj", "down_proj")
                ]
                if self.shared_expert_intermediate_size:
                    names += [f"{p}mlp.shared_expert.{m}.weight"
                              for m in ("gate_proj", "up_proj", "down_proj")]
                    names.append(f"{p}mlp.shared_expert_gate.weight")
            else:
                names += [f"{p}mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
            names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
            if self.traits.gemma_norms:
                names += [
                    f"{p}pre_feedforward_layernorm.weight",
                    f"{p}post_feedforward_layernorm.weight",
                ]
        names.append("model.norm.weight")
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of each weight in HF layout ([out_features, in_features])."""
        h = self.hidden_size
        # OLMoE normalises the whole q and k projections, the others each head
        q_norm, k_norm = (
            (self.q_size, self.kv_size) if self.traits.qk_norm_full else (self.head_dim,) * 2
        )
        shapes: dict[str, tuple[int, ...]] = {}
        for name in self.weight_names():
            leaf = name.rsplit(".", 2)[-2]  # q_proj, mlp gate_proj, input_layernorm, ...
            is_bias = name.endswith(".bias")
            f = (
                self.moe_intermediate_size if ".experts." in name
                else self.shared_expert_intermediate_size if ".shared_expert." in name
                else self.intermediate_size
            )
            out, inp = {
                "embed_tokens": (self.vocab_size, h),
                "lm_head": (self.vocab_size, h),
                "q_proj": (self.q_size, h),
                "k_proj": (self.kv_size, h),
                "v_proj": (self.kv_size, h),
                "o_proj": (h, self.q_size),
                "gate_proj": (f, h),
                "up_proj": (f, h),
                "down_proj": (h, f),
                "q_norm": (q_norm, None),
                "k_norm": (k_norm, None),
                "gate": (self.num_experts, h),  # the MoE router
                "shared_expert_gate": (1, h),
            }.get(leaf, (h, None))
            shapes[name] = (out,) if is_bias or inp is None else (out, inp)
        return shapes
