"""The collectives of a tensor-parallel forward pass, over torch.distributed.

One process per rank; the default process group carries the model's collectives (gloo on CPU,
NCCL on CUDA: `backend_for`), and a gloo group on CPU carries the control channel
(tessera/distributed/channel.py), as NCCL moves only device tensors.

Per step and layer, two all-reduces of the residual stream's delta [num_tokens, hidden] (after
o_proj and after down_proj), one for the vocab-parallel embedding, and one gather of the logits
shards to rank 0, the only rank that samples. Every call is timed (`stats`): the benchmark reads
how much of a step the all-reduces take.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.distributed.sharding import ShardPlan


def backend_for(device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA: chosen from the device, never configured by hand."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def resolve_init_method(method: str | None) -> str:
    """--distributed-init-method, else torchrun's MASTER_ADDR/MASTER_PORT (env://)."""
    if method is not None:
        return method
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return "env://"
    raise ValueError("no --distributed-init-method and no MASTER_ADDR/MASTER_PORT")


@dataclass
class CollectiveStats:
    """Seconds and calls of the all-reduces since start (rank-local)."""

    num_all_reduce: int = 0
    all_reduce_seconds: float = 0.0
    all_reduce_bytes: int = 0
    num_gather: int = 0
    gather_seconds: float = 0.0


class TensorParallelGroup:
    """This rank's view of the group: its `ShardPlan` and the collectives the model calls."""

    def __init__(self, plan: ShardPlan, device: torch.device):
        self.plan = plan
        self.rank = plan.rank
        self.world_size = plan.world_size
        self.device = device
        self.stats = CollectiveStats()

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (returns t). CPU collectives are synchronous, so the timing
        is the collective's own; on CUDA it times the launch only."""
        t0 = time.perf_counter()
        dist.all_reduce(t)
        s = self.stats
        s.all_reduce_seconds += time.perf_counter() - t0
        s.num_all_reduce += 1
        s.all_reduce_bytes += t.numel() * t.element_size()
        return t

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor | None:
        """Logits shards [n, vocab_shard] of every rank -> [n, vocab] on rank 0; None elsewhere.
        The last rank's shard may be short: padded here, cut after the gather."""
        t0 = time.perf_counter()
        width = self.plan.vocab_shard_size
        if local.shape[-1] < width:
            local = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
        local = local.contiguous()
        parts = (
            [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else None
        )
        dist.gather(local, parts, dst=0)
        self.stats.gather_seconds += time.perf_counter() - t0
        self.stats.num_gather += 1
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[..., : self.plan.vocab_size]
