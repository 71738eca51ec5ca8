"""The analytical cost model: a roofline per step from the model's config and a hardware spec.

A step is two kernels families, each bound by compute or by memory, whichever is slower:

    linear    = max(FLOPs of every linear for the step's tokens (LM head per sequence),
                    weight bytes streamed once)                 / (peak * efficiency)
    attention = max(4 * layers * heads * head_dim per (query, key) pair,
                    KV bytes of every distinct block read once) / (peak * efficiency)
    step      = linear + attention + step_overhead_s (host work: scheduling, launches, sampling)
    swap      = swap bytes / host link bandwidth (blocking, as the runner's swap is)

Under `--tensor-parallel-size N` each of N such devices holds 1/N of the weights, of the query
heads and of the KV heads (or one replicated KV head when N is a multiple of their number, as the
engine shards them: tessera/distributed/sharding.py), so the FLOPs and bytes above are divided
among them, `--kv-cache-space` is per device (as on the server), and every step adds the ring
all-reduces over the spec's `tp_link` (parallel.py). A mixture of experts' experts are each
sliced N ways, or with --enable-expert-parallel placed whole: then the rank holding the most
experts (ceil(E/N) of E) reads the most expert bytes and sets the step's pace.

A mixture of experts streams only the experts its step's tokens chose: the expected number of
distinct experts B tokens touch, E (1 - (1 - k/E)^B) (specs.py), so its weight bytes grow with
the batch from the active parameters towards all of them, while its FLOPs follow the k experts
of each token.

Decode batches are memory-bound until the batch is large (the weights are read once for all of
them); prefill is compute-bound. What it leaves out (kernel launch gaps beyond the fixed overhead,
wave quantisation, activation traffic, the prefill attention's re-reads of KV tiles) is listed in
docs/simulator.md.
"""

from __future__ import annotations

from tessera.config import GiB
from tessera.simulator.batch import BatchShape
from tessera.simulator.cost_model import CostModel, KVGeometry
from tessera.simulator.parallel import TensorParallelCost, parse_link
from tessera.simulator.specs import DTYPE_BYTES, HardwareSpec, ModelSpec


class RooflineCostModel(CostModel):
    name = "roofline"

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, dtype: str,
                 tensor_parallel_size: int = 1, kv_cache_dtype: str | None = None,
                 expert_parallel: bool = False) -> None:
        """`kv_cache_dtype` is the resolved --kv-cache-dtype (None: the compute dtype): it sizes
        the KV blocks and the bytes attention reads, as the engine's cache does.
        `expert_parallel` (--enable-expert-parallel) places whole experts on the ranks, as the
        engine does: the rank holding the most experts sets the step's pace."""
        kv_dtype = kv_cache_dtype or dtype
        for flag, value in (("--dtype", dtype), ("--kv-cache-dtype", kv_dtype)):
            if value not in DTYPE_BYTES:
                raise ValueError(f"{flag} {value!r} is not one of {', '.join(DTYPE_BYTES)}")
        n = tensor_parallel_size
        self.model, self.hardware, self.dtype = model, hardware, dtype
        self.tensor_parallel_size = n
        kv_heads = model.num_kv_heads
        # the largest share of the routed experts one rank holds: 1/n of each (sliced), or
        # whole experts, ceil(E/n) of E on the fullest rank (expert parallelism)
        self.expert_parallel = expert_parallel and model.is_moe and n > 1
        self._expert_share = 1 / n
        if n > 1:
            from tessera.distributed.sharding import check_shardable, expert_placement

            check_shardable(model.num_heads, kv_heads, model.dense_intermediate_size, n,
                            num_experts=model.num_experts if model.is_moe else 0,
                            moe_intermediate_size=model.moe_intermediate_size,
                            shared_expert_intermediate_size=model.shared_expert_intermediate_size,
                            expert_parallel=self.expert_parallel,
                            architecture=model.architecture)
            if self.expert_parallel:
                fullest = max(len(r) for r in expert_placement(model.num_experts, n))
                self._expert_share = fullest / model.num_experts
            # a multiple of the KV heads replicates them: each rank keeps the one its queries read
            kv_heads = 1 if kv_heads % n else kv_heads // n
            self.tp = TensorParallelCost.for_model(n, model.num_layers, model.hidden_size,
                                                   model.vocab_size, DTYPE_BYTES[dtype],
                                                   hardware.link("tp_link"))
        self.kv_link = parse_link(hardware.kv_link, f"--hardware {hardware.name} kv_link")
        # one device's share (all of it at n = 1): KV geometry, FLOPs and bytes per rank
        self.geometry = KVGeometry(
            model.num_layers, kv_heads, model.head_dim, DTYPE_BYTES[kv_dtype]
        )
        self.max_model_len = model.max_position_embeddings
        self.sliding_window = model.sliding_window
        self.layer_windows = model.layer_windows  # mixed local and global layers: KV cache groups
        self._flops = hardware.flops(dtype) * hardware.compute_efficiency * n  # n devices
        self._bandwidth = hardware.memory_bandwidth * hardware.memory_efficiency
        self._kv_bytes_per_token = self.geometry.block_bytes(1)

    def check_fits(self, kv_cache_space_gib: float) -> None:
        """The weights and the KV cache (--kv-cache-space) must fit in the device's memory."""
        weights = self.model.num_params * DTYPE_BYTES[self.dtype] / self.tensor_parallel_size
        need = weights + kv_cache_space_gib * GiB
        if need > self.hardware.memory_bytes:
            raise ValueError(
                f"--kv-cache-space {kv_cache_space_gib} GiB plus {weights / GiB:.1f} GiB of "
                f"{self.model.name} weights exceed the {self.hardware.memory_bytes / GiB:.0f} GiB "
                f"of --hardware {self.hardware.name}: lower --kv-cache-space")

    def linear_time(self, batch: BatchShape) -> float:
        m = self.model
        flops = batch.num_tokens * m.linear_flops_per_token + batch.num_seqs * m.lm_head_flops
        # a dense model's bytes are the same every step; a MoE's follow the experts touched
        total = m.weight_bytes_per_step(self.dtype, batch.num_tokens)
        experts = m.expert_bytes_per_step(self.dtype, batch.num_tokens)
        weight_bytes = (total - experts) / self.tensor_parallel_size + experts * self._expert_share
        return max(flops / self._flops, weight_bytes / self._bandwidth)

    def attention_time(self, batch: BatchShape) -> float:
        flops = batch.num_attention_pairs * self.model.attention_flops_per_pair
        # a block several sequences read (a shared prefix) streams from memory once
        kv_bytes = batch.num_distinct_context_tokens * self._kv_bytes_per_token
        return max(flops / self._flops, kv_bytes / self._bandwidth)

    def compute_time(self, batch: BatchShape) -> float:
        if batch.num_tokens == 0:
            return 0.0
        return self.linear_time(batch) + self.attention_time(batch) + self.hardware.step_overhead_s

    def swap_time(self, batch: BatchShape) -> float:
        return batch.swap_bytes / self.hardware.host_bandwidth

    def describe(self) -> dict:
        return {"cost_model": self.name, "model_config": self.model.name,
                "hardware": self.hardware.name, "hardware_source": self.hardware.source,
                "dtype": self.dtype, "tensor_parallel_size": self.tensor_parallel_size,
                "enable_expert_parallel": self.expert_parallel}
