"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2 with q/k/v bias)
over a flat batch of tokens and a paged KV cache.

Plain tensors and small callables rather than nn.Modules: the forward is a fixed loop over layers
and the per-op dispatch overhead is what bounds batch-1 decode on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.attention import AttentionMetadata
from tessera.model.config import ModelArchConfig
from tessera.model.layers import Linear, RMSNorm, RotaryEmbedding, SiluAndMul


class LlamaLayer:
    def __init__(self, cfg: ModelArchConfig, w: dict[str, torch.Tensor], prefix: str):
        def get(name: str) -> torch.Tensor:
            return w[f"{prefix}.{name}"]

        attn = "self_attn"
        qkv = torch.cat([get(f"{attn}.q_proj.weight"), get(f"{attn}.k_proj.weight"), get(f"{attn}.v_proj.weight")])
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = torch.cat([get(f"{attn}.q_proj.bias"), get(f"{attn}.k_proj.bias"), get(f"{attn}.v_proj.bias")])
        self.wqkv = Linear(qkv, qkv_bias)  # fused q/k/v: one matmul
        self.wo = Linear(get(f"{attn}.o_proj.weight"))
        self.w13 = Linear(torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]))  # gate|up
        self.w2 = Linear(get("mlp.down_proj.weight"))
        self.input_norm = RMSNorm(get("input_layernorm.weight"), cfg.rms_norm_eps)
        self.post_attn_norm = RMSNorm(get("post_attention_layernorm.weight"), cfg.rms_norm_eps)
        self.act = SiluAndMul(qkv.device, qkv.dtype)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim

    def __call__(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        rope: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """h is the residual stream, updated in place and returned."""
        n = h.shape[0]
        qkv = self.wqkv(self.input_norm(h))  # [n, (H + 2 * KVH) * D]
        rope.apply_(qkv, cos, sin, self.num_heads + self.num_kv_heads)  # q and k are adjacent
        q = qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.qk_size].view(n, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.qk_size :].view(n, self.num_kv_heads, self.head_dim)
        attn = meta.forward(q, k, v, k_cache, v_cache, self.scale)  # [n, H, D]
        x = self.post_attn_norm.add_and_norm(h, self.wo(attn.view(n, -1)))
        return h.add_(self.w2(self.act(self.w13(x))))


class LlamaForCausalLM:
    """Weights arrive in HF names (see tessera/model/loader.py) as float32; they are cast to the
    compute dtype, fused, and moved to the device here."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        w = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
        self.embed = w["model.embed_tokens.weight"]  # [vocab, hidden]
        self.layers = [LlamaLayer(cfg, w, f"model.layers.{i}") for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(w["model.norm.weight"], cfg.rms_norm_eps)
        lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = Linear(lm_head)
        self.rope = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] (normed); logits are computed separately, only
        where the runner samples."""
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rope.lookup(positions)  # once per step, shared by every layer
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h = layer(h, self.rope, cos, sin, k_cache, v_cache, meta)
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> float32 logits [n, vocab]."""
        return self.lm_head(hidden).float()
