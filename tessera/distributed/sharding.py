"""Megatron-style sharding of a Llama-family decoder over `world_size` ranks, per HF tensor name.

    q_proj, k_proj, v_proj   column-parallel by heads (rows of [out, in]); KV heads are split when
                             world_size divides num_key_value_heads, else (world_size a multiple of
                             them) each rank keeps the one KV head its query heads read: replicated
    o_proj, down_proj        row-parallel (columns: the input features); an all-reduce follows
    gate_proj, up_proj       column-parallel (a shared expert's too; its gate is replicated)
    embed_tokens, lm_head    vocab-parallel: rows [rank * ceil(V/N), ...); logits are gathered
    norms, the MoE router    replicated
    experts (MoE layers)     each expert's gate/up/down sliced like a dense MLP (every rank holds
                             a slice of every expert); or, with --enable-expert-parallel, whole
                             experts placed on ranks (`expert_placement`), the others not read

Expert parallelism here is the gather/scatter form: after attention's all-reduce every rank has
every token, routes all of them (the router is replicated, so all ranks agree), runs only its own
experts on the tokens routed to them, and the all-reduce that follows the MLP sums the ranks'
partial outputs. No extra collective: the tokens "go" to their experts' ranks because every rank
already has them, and "come back" in the MLP's all-reduce.

The plan slices each tensor on its own, before the loaders hand it over, so q|k|v and gate|up are
fused (and packed for the kernels) from per-rank shards, and a rank never holds the whole model.
GGUF blocks: a column slice must start and end on a block boundary (32 values for Q4_0/Q4_1/Q8_0,
256 for K-quants); a slice that does not is dequantized instead (logged), so it still loads.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
import torch

from tessera.utils import QK_NORM_OVER_ALL_HEADS, cdiv

logger = logging.getLogger(__name__)

Slice = tuple[int, int, int]  # (dim, start, stop) of an HF-layout tensor [out, in]


def check_shardable(num_heads: int, num_kv_heads: int, intermediate_size: int | None,
                    world_size: int, *, num_experts: int = 0, moe_intermediate_size: int = 0,
                    shared_expert_intermediate_size: int = 0, expert_parallel: bool = False,
                    architecture: str = "") -> None:
    """ValueError naming the numbers unless the model splits evenly over `world_size` ranks.
    `intermediate_size` None: no layer has a dense MLP (every one is MoE). Called before any
    weight is read, by the engine and by the simulator alike (the same refusals in both)."""
    n = world_size
    if n > 1 and architecture in QK_NORM_OVER_ALL_HEADS:
        raise ValueError(f"--tensor-parallel-size {n}: {architecture} normalises q and k over "
                         "all heads at once, which a rank's slice of the heads cannot; use 1")
    if shared_expert_intermediate_size % n:
        raise ValueError(f"--tensor-parallel-size {n} does not divide the model's "
                         f"shared_expert_intermediate_size ({shared_expert_intermediate_size})")
    if num_heads % n:
        raise ValueError(f"--tensor-parallel-size {n} does not divide the model's "
                         f"num_attention_heads ({num_heads}); use a divisor of {num_heads}")
    if num_kv_heads % n and n % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {n} neither divides the model's "
                         f"num_key_value_heads ({num_kv_heads}) nor is a multiple of it (then "
                         "the KV heads would be replicated)")
    if intermediate_size is not None and intermediate_size % n:
        raise ValueError(f"--tensor-parallel-size {n} does not divide the model's "
                         f"intermediate_size ({intermediate_size})")
    if num_experts == 0:
        return
    if expert_parallel:
        expert_placement(num_experts, n)  # refuses more ranks than experts
    elif moe_intermediate_size % n:
        raise ValueError(f"--tensor-parallel-size {n} does not divide the model's "
                         f"moe_intermediate_size ({moe_intermediate_size}), which slices every "
                         "expert; add --enable-expert-parallel to place whole experts instead")


def expert_placement(num_experts: int, world_size: int) -> list[range]:
    """The experts each rank holds under --enable-expert-parallel: contiguous blocks of
    E // N, the first E % N ranks one more (vLLM's linear placement), so an uneven split costs
    at most one expert of imbalance. More ranks than experts is refused (a rank with none)."""
    e, n = num_experts, world_size
    if n > e:
        raise ValueError(f"--enable-expert-parallel with --tensor-parallel-size {n} would leave "
                         f"ranks without an expert: the model has num_experts ({e}); use at most "
                         f"{e} ranks, or drop --enable-expert-parallel to slice each expert")
    base, extra = divmod(e, n)
    starts = [r * base + min(r, extra) for r in range(n + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(n)]


_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # model.layers.{i}.mlp.experts.{e}.{proj}.weight


def expert_of(name: str) -> int | None:
    """The expert id of an expert weight's HF name; None for any other weight."""
    m = _EXPERT.search(name)
    return None if m is None else int(m.group(1))


@dataclass(frozen=True)
class ShardPlan:
    """Which slice of every weight rank `rank` of `world_size` keeps."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int | None  # the dense MLP's; None when every layer is MoE
    vocab_size: int
    # mixture of experts (0 experts: a dense model)
    moe_intermediate_size: int = 0  # each expert's
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (always sliced)
    num_experts: int = 0
    expert_parallel: bool = False  # whole experts per rank (else each expert sliced)

    def __post_init__(self) -> None:
        check_shardable(self.num_heads, self.num_kv_heads, self.intermediate_size,
                        self.world_size, num_experts=self.num_experts,
                        moe_intermediate_size=self.moe_intermediate_size,
                        shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                        expert_parallel=self.expert_parallel)
        assert 0 <= self.rank < self.world_size

    @classmethod
    def for_arch(cls, arch, rank: int, world_size: int,
                 expert_parallel: bool = False) -> ShardPlan:
        """The plan of a `ModelArchConfig`; ValueError if the architecture cannot be sliced.
        `expert_parallel` (--enable-expert-parallel) places whole experts; a dense model has
        none to place, so it shards as without it."""
        if world_size > 1:  # what the plan's own numbers cannot tell
            check_shardable(arch.num_attention_heads, arch.num_key_value_heads, None, world_size,
                            architecture=arch.architecture)
        num_experts = arch.num_experts
        layers = range(arch.num_hidden_layers)
        dense = num_experts == 0 or not all(arch.is_moe_layer(i) for i in layers)
        moe = arch.moe_intermediate_size if num_experts else 0
        shared = arch.shared_expert_intermediate_size if num_experts else 0
        return cls(rank, world_size, arch.num_attention_heads, arch.num_key_value_heads,
                   arch.head_dim, arch.intermediate_size if dense else None, arch.vocab_size,
                   moe, shared, num_experts, expert_parallel and num_experts > 0)

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

    @property
    def expert_ids(self) -> range:
        """The experts this rank runs: its block under expert parallelism, else all of them
        (each sliced)."""
        if not self.expert_parallel:
            return range(self.num_experts)
        return expert_placement(self.num_experts, self.world_size)[self.rank]

    # ---- slices ------------------------------------------------------------------------------
    def holds(self, name: str) -> bool:
        """Whether this rank keeps any of HF weight `name`: all but the experts another rank
        owns under expert parallelism (those are never read)."""
        expert = expert_of(name) if self.expert_parallel else None
        return expert is None or expert in self.expert_ids

    def slice_of(self, name: str) -> Slice | None:
        """The (dim, start, stop) rank keeps of HF weight `name`; None: the whole (replicated,
        or a whole expert under expert parallelism)."""
        d, r = self.head_dim, self.rank
        leaf = name.rsplit(".", 2)[-2]
        if expert_of(name) is not None:
            if self.expert_parallel:
                return None
            i = self.moe_intermediate_size // self.world_size
            return (1, r * i, (r + 1) * i) if leaf == "down_proj" else (0, r * i, (r + 1) * i)
        if leaf == "q_proj":
            q = self.num_local_heads * d
            return (0, r * q, (r + 1) * q)
        if leaf in ("k_proj", "v_proj"):
            first = self.first_kv_head * d
            return (0, first, first + self.num_local_kv_heads * d)
        if leaf == "o_proj":
            q = self.num_local_heads * d
            return (1, r * q, (r + 1) * q)
        i = (self.shared_expert_intermediate_size if ".shared_expert." in name
             else self.intermediate_size or 0) // self.world_size
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
