"""Megatron-style sharding of a Llama-family decoder over `world_size` ranks, per HF tensor name.

    q_proj, k_proj, v_proj   column-parallel by heads (rows of [out, in]); KV heads are split when
                             world_size divides num_key_value_heads, else (world_size a multiple of
                             them) each rank keeps the one KV head its query heads read: replicated
    o_proj, down_proj        row-parallel (columns: the input features); an all-reduce follows
    gate_proj, up_proj       column-parallel (MoE: each expert's too, by moe_intermediate_size,
                             and the shared expert's; the router `mlp.gate` and the shared
                             expert's gate are replicated)
    embed_tokens, lm_head    vocab-parallel: rows [rank * ceil(V/N), ...); logits are gathered
    norms                    replicated

The plan slices each tensor on its own, before the loaders hand it over, so q|k|v and gate|up are
fused (and packed for the kernels) from per-rank shards, and a rank never holds the whole model.
GGUF blocks: a column slice must start and end on a block boundary (32 values for Q4_0/Q4_1/Q8_0,
256 for K-quants); a slice that does not is dequantized instead (logged), so it still loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tessera.utils import cdiv

logger = logging.getLogger(__name__)

Slice = tuple[int, int, int]  # (dim, start, stop) of an HF-layout tensor [out, in]


def check_shardable(num_heads: int, num_kv_heads: int, intermediate_size: int,
                    world_size: int) -> None:
    """ValueError naming the numbers unless the model splits evenly over `world_size` ranks.
    Called before any weight is read."""
    n = world_size
    if num_heads % n:
        raise ValueError(f"--tensor-parallel-size {n} does not divide the model's "
                         f"num_attention_heads ({num_heads}); use a divisor of {num_heads}")
    if num_kv_heads % n and n % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {n} neither divides the model's "
                         f"num_key_value_heads ({num_kv_heads}) nor is a multiple of it (then "
                         "the KV heads would be replicated)")
    if intermediate_size % n:
        raise ValueError(f"--tensor-parallel-size {n} does not divide the model's "
                         f"intermediate_size ({intermediate_size})")


@dataclass(frozen=True)
class ShardPlan:
    """Which slice of every weight rank `rank` of `world_size` keeps."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    moe_intermediate_size: int = 0  # each expert's (0: a dense model)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert

    def __post_init__(self) -> None:
        check_shardable(self.num_heads, self.num_kv_heads, self.intermediate_size, self.world_size)
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, name) % self.world_size:
                raise ValueError(f"--tensor-parallel-size {self.world_size} does not divide the "
                                 f"model's {name} ({getattr(self, name)})")
        assert 0 <= self.rank < self.world_size

    @classmethod
    def for_arch(cls, arch, rank: int, world_size: int) -> ShardPlan:
        """The plan of a `ModelArchConfig`; ValueError if the architecture cannot be sliced."""
        if world_size > 1 and arch.traits.qk_norm_full:
            raise ValueError(f"--tensor-parallel-size {world_size}: {arch.architecture} "
                             "normalises q and k over all heads at once, which a rank's slice "
                             "of the heads cannot; use 1")
        moe = arch.moe_intermediate_size if arch.num_experts else 0
        shared = arch.shared_expert_intermediate_size if arch.num_experts else 0
        return cls(rank, world_size, arch.num_attention_heads, arch.num_key_value_heads,
                   arch.head_dim, arch.intermediate_size, arch.vocab_size, moe, shared)

    # ---- per-rank sizes ----------------------------------------------------------------------
    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def kv_replicated(self) -> bool:
        return self.num_kv_heads % self.world_size != 0

    @property
    def num_local_kv_heads(self) -> int:
        return 1 if self.kv_replicated else self.num_kv_heads // self.world_size

    @property
    def first_kv_head(self) -> int:
        if self.kv_replicated:  # ranks per KV head = N / KV; query heads stay in one group
            return self.rank // (self.world_size // self.num_kv_heads)
        return self.rank * self.num_local_kv_heads

    @property
    def vocab_shard_size(self) -> int:
        """Rows of the embedding and lm_head a rank holds at most (the last may hold fewer)."""
        return cdiv(self.vocab_size, self.world_size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        start = min(self.rank * self.vocab_shard_size, self.vocab_size)
        return start, min(start + self.vocab_shard_size, self.vocab_size)

    # ---- slices ------------------------------------------------------------------------------
    def slice_of(self, name: str) -> Slice | None:
        """The (dim, start, stop) rank keeps of HF weight `name`; None: the whole (replicated)."""
        d, r = self.head_dim, self.rank
        leaf = name.rsplit(".", 2)[-2]
        if leaf == "q_proj":
            q = self.num_local_heads * d
            return (0, r * q, (r + 1) * q)
        if leaf in ("k_proj", "v_proj"):
            first = self.first_kv_head * d
            return (0, first, first + self.num_local_kv_heads * d)
        if leaf == "o_proj":
            q = self.num_local_heads * d
            return (1, r * q, (r + 1) * q)
        i = (self.moe_intermediate_size if ".experts." in name
             else self.shared_expert_intermediate_size if ".shared_expert." in name
             else self.intermediate_size) // self.world_size
        if leaf in ("gate_proj", "up_proj"):
            return (0, r * i, (r + 1) * i)
        if leaf == "down_proj":
            return (1, r * i, (r + 1) * i)
        if leaf in ("embed_tokens", "lm_head"):
            return (0, *self.vocab_range)
        return None

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        s = self.slice_of(name)
        if s is None or (s[0] == 1 and len(shape) == 1):
            return shape
        dim, start, stop = s
        return shape[:dim] + (stop - start,) + shape[dim + 1 :]

    def shard(self, name: str, w):
        """Rank's slice of one weight (a float tensor or numpy array, or GGUF blocks), copied so
        the full tensor can be freed. Biases follow their weight's rows."""
        s = self.slice_of(name)
        if s is None or (s[0] == 1 and len(w.shape) == 1):
            return w
        dim, start, stop = s
        if not isinstance(w, (torch.Tensor, np.ndarray)):  # GGUF blocks cut themselves
            return w.shard(dim, start, stop, name)  # (QuantizedTensor.shard, model/gguf_quant.py)
        index = (slice(None),) * dim + (slice(start, stop),)
        if isinstance(w, np.ndarray):
            return np.ascontiguousarray(w[index]).copy()
        return w[index].contiguous().clone()
