"""The decoder every supported family shares (Llama 2/3, SmolLM2, Mistral, Qwen2/3, Gemma 2/3,
Phi-3) over a flat batch of tokens and a paged KV cache. A family is Llama plus the differences
its `ArchTraits` (tessera/model/registry.py) and its config name:

    Qwen2       bias on q/k/v
    Qwen3       RMSNorm over each head of q and k before RoPE
    Mistral     a sliding window on every layer
    Gemma 2/3   (1 + w) norms, norms after attention and after the MLP, GeGLU, embeddings scaled
                by sqrt(hidden), query_pre_attn_scalar; local (sliding) and global layers, with
                their own RoPE base in Gemma 3; soft-capped scores and logits in Gemma 2
    Phi-3       fused checkpoint tensors (split at load), LongRoPE, partial rotary dims
    Qwen3-MoE   Qwen3 with sparse mixture-of-experts blocks in place of the MLP (tessera/model/
                moe.py) on the layers the config names (decoder_sparse_step, mlp_only_layers)
    OLMoE       MoE blocks; its q/k RMSNorm spans the whole projection, not each head; clip_qkv
    Mixtral     Mistral with MoE blocks (top-k weights renormalised)
    Qwen2-MoE   Qwen2 with MoE blocks and a shared expert beside the routed ones

Plain tensors and small callables rather than nn.Modules: the forward is a fixed loop over layers
and the per-op dispatch overhead is what bounds batch-1 decode on CPU.

Tensor parallelism (`tp`, tessera/distributed): the weights arrive already sharded per rank
(tessera/distributed/sharding.py), so every shape here is the rank's own (its query and KV heads,
its slice of the MLP and of the vocabulary); the forward adds the all-reduces after o_proj and
down_proj, and the embedding and the logits are vocab-parallel.
"""

from __future__ import annotations

import torch

from tessera.attention import AttentionMetadata
from tessera.distributed.group import TensorParallelGroup
from tessera.kernels.quant_linear import QuantLinear, pairs_layout
from tessera.model.config import ModelArchConfig
from tessera.model.gguf_quant import QuantizedTensor
from tessera.model.layers import (
    Embedding,
    GeluTanhAndMul,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    Weight,
    make_linear,
)
from tessera.model.moe import FusedMoE


class LlamaLayer:
    def __init__(
        self,
        cfg: ModelArchConfig,
        w: dict[str, Weight],
        prefix: str,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup | None = None,
    ):
        def get(name: str) -> Weight:
            return w[f"{prefix}.{name}"]

        def dense(name: str) -> torch.Tensor:
            t = get(name)
            assert isinstance(t, torch.Tensor), f"{name} is never quantized"
            return t

        def linear(names: list[str], bias: torch.Tensor | None = None):
            return make_linear([get(n) for n in names], bias, dtype, device)

        family = cfg.traits

        def norm(name: str) -> RMSNorm:
            w = dense(name)
            if family.gemma_norms:  # Gemma scales by (1 + w), the sum taken in float32
                w = (1.0 + w.float()).to(dtype)
            return RMSNorm(w, cfg.rms_norm_eps)

        attn = "self_attn"
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = torch.cat([dense(f"{attn}.{p}_proj.bias") for p in "qkv"])
        # fused q/k/v and gate|up: one matmul each
        self.wqkv = linear([f"{attn}.{p}_proj.weight" for p in "qkv"], qkv_bias)
        self.wo = linear([f"{attn}.o_proj.weight"])
        self.act = (SiluAndMul(device, dtype) if family.activation == "silu"
                    else GeluTanhAndMul())
        layer_index = int(prefix.rsplit(".", 1)[1])
        # a sparse MoE block, or the dense MLP (w13, w2: LoRA wraps these by name)
        self.moe: FusedMoE | None = None
        if cfg.is_moe_layer(layer_index):
            # under tensor parallelism: a slice of every expert, or (expert parallelism) this
            # rank's whole experts; the all-reduce after the MLP sums the ranks' shares
            self.moe = FusedMoE.from_weights(cfg, w, f"{prefix}.mlp", dtype, device, self.act,
                                             expert_ids=None if tp is None else tp.plan.expert_ids)
        else:
            self.w13 = linear(["mlp.gate_proj.weight", "mlp.up_proj.weight"])
            self.w2 = linear(["mlp.down_proj.weight"])
        self.input_norm = norm("input_layernorm.weight")
        self.post_attn_norm = norm("post_attention_layernorm.weight")
        # Gemma's sandwich: post_attn_norm normalises the attention output; these two wrap the MLP
        self.pre_mlp_norm = self.post_mlp_norm = None
        if family.gemma_norms:
            self.pre_mlp_norm = norm("pre_feedforward_layernorm.weight")
            self.post_mlp_norm = norm("post_feedforward_layernorm.weight")
        self.q_norm = self.k_norm = None
        if family.qk_norm:
            self.q_norm = norm(f"{attn}.q_norm.weight")
            self.k_norm = norm(f"{attn}.k_norm.weight")
        self.qk_norm_full = family.qk_norm_full
        self.clip_qkv = cfg.clip_qkv
        self.tp = tp
        self.num_heads = cfg.num_attention_heads if tp is None else tp.plan.num_local_heads
        self.num_kv_heads = cfg.num_key_value_heads if tp is None else tp.plan.num_local_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        self.window = cfg.layer_window(layer_index)
        self.q_size = self.num_heads * self.head_dim
        self.qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim

    def __call__(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        pending: torch.Tensor | None,  # [num_tokens, hidden] the previous layer's MLP output
        rope: RotaryEmbedding,  # this layer's (Gemma 3's local layers have their own)
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h is the residual stream, updated in place. Returns (h, this layer's MLP output): the
        residual add of the MLP output is left to the next norm, which adds and normalises in
        one pass (`RMSNorm.add_and_norm`), the same values as adding here."""
        n = h.shape[0]
        x = self.input_norm(h) if pending is None else self.input_norm.add_and_norm(h, pending)
        qkv = self.wqkv(x)  # [n, (H + 2 * KVH) * D]
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads_(qkv, n)
        if self.clip_qkv is not None:  # OLMoE
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        rope.apply_(qkv, cos, sin, self.num_heads + self.num_kv_heads)  # q and k are adjacent
        attn = meta.forward_qkv(qkv, self.num_heads, self.num_kv_heads, k_cache, v_cache,
                                self.scale, window=self.window, softcap=self.softcap)  # [n, H D]
        o = self.wo(attn)
        if self.tp is not None:  # row-parallel: each rank holds a partial sum
            self.tp.all_reduce_(o)
        if self.pre_mlp_norm is None:
            x = self.post_attn_norm.add_and_norm(h, o)
        else:  # Gemma: h += norm(o); x = norm(h)
            x = self.pre_mlp_norm.add_and_norm(h, self.post_attn_norm(o))
        down = self.moe(x) if self.moe is not None else self.w2(self.act(self.w13(x)))
        if self.tp is not None:
            self.tp.all_reduce_(down)
        if self.post_mlp_norm is not None:
            down = self.post_mlp_norm(down)
        return h, down

    def _norm_heads_(self, qkv: torch.Tensor, n: int) -> None:
        """Qwen3 / Gemma 3: RMSNorm over each head of q and of k (in place, before RoPE); OLMoE:
        over the whole q and the whole k of each token."""
        assert self.q_norm is not None and self.k_norm is not None
        if self.qk_norm_full:
            q = qkv[:, : self.q_size].contiguous()
            k = qkv[:, self.q_size : self.qk_size].contiguous()
            qkv[:, : self.q_size] = self.q_norm(q)
            qkv[:, self.q_size : self.qk_size] = self.k_norm(k)
            return
        d = self.head_dim
        q = qkv[:, : self.q_size].reshape(n * self.num_heads, d)
        k = qkv[:, self.q_size : self.qk_size].reshape(n * self.num_kv_heads, d)
        qkv[:, : self.q_size] = self.q_norm(q).view(n, -1)
        qkv[:, self.q_size : self.qk_size] = self.k_norm(k).view(n, -1)


class LlamaForCausalLM:
    """Weights arrive in HF names (see tessera/model/loader.py) as float32 tensors, or as GGUF
    blocks (`QuantizedTensor`, --quantization gguf); they are cast to the compute dtype (or
    packed for the quantized kernel), fused, and moved to the device here."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        tp: TensorParallelGroup | None = None,
    ):
        self.cfg = cfg
        self.tp = tp
        self.dtype = dtype
        self.device = device
        w: dict[str, Weight] = {
            name: t if isinstance(t, QuantizedTensor) else t.to(device=device, dtype=dtype)
            for name, t in weights.items()
        }
        self.layers = [
            LlamaLayer(cfg, w, f"model.layers.{i}", dtype, device, tp)
            for i in range(cfg.num_hidden_layers)
        ]
        norm = w["model.norm.weight"]
        assert isinstance(norm, torch.Tensor)
        if cfg.traits.gemma_norms:
            norm = (1.0 + norm.float()).to(dtype)
        self.norm = RMSNorm(norm, cfg.rms_norm_eps)
        # Gemma: embeddings times sqrt(hidden), the factor rounded to the compute dtype as in HF
        self.embed_scale = (
            torch.tensor(cfg.hidden_size**0.5, dtype=dtype).item()
            if cfg.traits.gemma_norms else None
        )
        self.final_softcap = cfg.final_logit_softcapping
        embed = w["model.embed_tokens.weight"]  # [vocab, hidden]
        head = embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = make_linear([head], None, dtype, device)
        if isinstance(embed, QuantizedTensor) and cfg.tie_word_embeddings:
            assert isinstance(self.lm_head, QuantLinear)
            self.embed = Embedding(self.lm_head.parts[0], dtype)  # one packed copy for both
        elif isinstance(embed, QuantizedTensor):
            self.embed = Embedding(_to_part(embed, dtype, device), dtype)
        else:
            self.embed = Embedding(embed, dtype)
        self.rope = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device,
            rotary_dim=cfg.rotary_dim,
        )
        # Gemma 3's local layers: their own base, no scaling
        self.local_rope: RotaryEmbedding | None = None
        if cfg.rope_local_base_freq is not None and any(cfg.layer_windows):
            self.local_rope = RotaryEmbedding(
                cfg.head_dim, max_positions, cfg.rope_local_base_freq, None, dtype, device,
                rotary_dim=cfg.rotary_dim,
            )

    def weight_bytes(self) -> dict[str, int]:
        """Resident bytes of weights by kind: "linear" (streamed once per step: every layer's
        projections, MoE routers and shared experts, and the lm_head), "experts" (the routed
        MoE experts held here, of which a step reads only those its tokens chose) and
        "embedding" (0 when it shares the lm_head's copy)."""
        linears = [self.lm_head]
        experts = 0
        for layer in self.layers:
            linears += [layer.wqkv, layer.wo]
            if layer.moe is None:
                linears += [layer.w13, layer.w2]
            else:
                experts += layer.moe.weight_bytes
        linear = sum(lin.weight_bytes for lin in linears) + sum(
            layer.moe.dense_weight_bytes for layer in self.layers if layer.moe is not None)
        shared = (
            isinstance(self.lm_head, QuantLinear) and self.embed.weight is self.lm_head.parts[0]
        )
        return {"linear": linear, "experts": experts,
                "embedding": 0 if shared else self.embed.weight_bytes}

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
        h = self.embed(input_ids) if self.tp is None else self._embed_vocab_parallel(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        cos, sin = self.rope.lookup(positions)  # once per step, shared by every layer
        local = None
        if self.local_rope is not None:
            local = (self.local_rope, *self.local_rope.lookup(positions))
        pending = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            m = meta.for_layer(i)  # its KV cache group's block tables
            if local is not None and layer.window is not None:
                h, pending = layer(h, pending, *local, k_cache, v_cache, m)
            else:
                h, pending = layer(h, pending, self.rope, cos, sin, k_cache, v_cache, m)
        return self.norm(h) if pending is None else self.norm.add_and_norm(h, pending)

    def _embed_vocab_parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each rank looks up the ids in its vocabulary slice (zeros for the others); the sum
        over ranks is the embedding."""
        assert self.tp is not None
        start, end = self.tp.plan.vocab_range
        mine = (input_ids >= start) & (input_ids < end)
        h = self.embed((input_ids - start).clamp_(0, max(end - start - 1, 0)))  # [n, hidden]
        h.mul_(mine.unsqueeze(-1).to(h.dtype))
        return self.tp.all_reduce_(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden] -> float32 logits [n, vocab]. Tensor-parallel: a collective every rank
        calls; the gathered logits come back on rank 0 only (None elsewhere)."""
        logits = self.lm_head(hidden).float()
        if self.tp is not None:
            gathered = self.tp.gather_vocab(logits)
            if gathered is None:
                return None
            logits = gathered
        if self.final_softcap is not None:  # Gemma 2
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def _to_part(w: QuantizedTensor, dtype: torch.dtype, device: torch.device):
    part = w.pack(pairs=pairs_layout(dtype, device))
    part.packed = part.packed.to(device)
    return part
