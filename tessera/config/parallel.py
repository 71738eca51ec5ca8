"""Where the model runs: tensor, pipeline and expert parallelism across processes, and threads."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (vLLM's names): the model and its KV cache split over
    `tensor_parallel_size` worker processes, one per rank, joined by torch.distributed (gloo on
    CPU, NCCL on CUDA). Across machines: `nnodes` launches of the same command, `node_rank` 0 the
    one with the engine and the server, all meeting at `distributed_init_method`
    (tcp://HOST:PORT; default: MASTER_ADDR/MASTER_PORT when set, else a free loopback port)."""

    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    # a mixture of experts' experts placed whole on the ranks instead of each sliced over them
    # (tessera/distributed/sharding.py); nothing to place with one rank or a dense model
    enable_expert_parallel: bool = False
    # threads of this node's compute (torch and the C++ kernels), shared by its ranks; None: every
    # core the process may run on (os.sched_getaffinity: a taskset or cgroup is respected)
    num_threads: int | None = None

    def __post_init__(self) -> None:
        n = self.num_threads
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"--num-threads must be an integer >= 1, got {n!r}")
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"--tensor-parallel-size must be an integer >= 1, got {tp!r}")
        if nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
        if tp % nnodes:
            raise ValueError(f"--tensor-parallel-size ({tp}) must be a multiple of --nnodes "
                             f"({nnodes}): every node runs the same number of ranks")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes) = [0, {nnodes}), got "
                             f"{self.node_rank}")
        method = self.distributed_init_method
        if method is not None and not method.startswith(("tcp://", "env://", "file://")):
            raise ValueError(f"--distributed-init-method must be tcp://HOST:PORT, env:// or "
                             f"file://PATH, got {method!r}")
        if nnodes > 1 and method is None and not os.environ.get("MASTER_ADDR"):
            raise ValueError("--nnodes > 1 needs --distributed-init-method tcp://HOST:PORT (or "
                             "MASTER_ADDR/MASTER_PORT in the environment), the same on every node")

    @property
    def threads_per_node(self) -> int:
        """--num-threads, else the cores this process may run on."""
        return self.num_threads if self.num_threads is not None else default_num_threads()

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this launch runs (node 0 holds rank 0, the one that samples)."""
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)


def default_num_threads() -> int:
    """The cores this process may run on (its affinity mask, not the machine's core count)."""
    return max(1, len(os.sched_getaffinity(0)))
