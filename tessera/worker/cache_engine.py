"""The KV tensors: a device pool and a CPU swap pool, and the block moves the scheduler asks for.

Both pools are one tensor each, `[num_slots, 2, num_blocks, block_size, num_kv_heads, head_dim]`,
so `kv_caches[layer] = (K, V)` are views and a swap or copy of any set of blocks is a single
batched index operation over all layers (no Python loop per block, nor per layer). Decides
nothing: it applies the block-id mappings in a `SchedulerOutput`.

One slot per layer, except with KV cache groups (a model mixing local and global layers,
core/kv_cache_groups.py): then there are `group_size` slots, slot j shared by layer j of every
group, and a block id is that row in every slot (the KV of one group's `group_size` layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.config import GiB, resolve_kv_cache_dtype
from tessera.core.kv_cache_groups import KVCacheGroupSpec, kv_cache_groups, layer_slots
from tessera.kernels.hugepages import zeros_in_huge_pages
from tessera.model.config import ModelArchConfig
from tessera.utils import kv_bytes_per_token


def kv_cache_torch_dtype(config) -> torch.dtype:
    """The KV cache's dtype for an EngineConfig: --kv-cache-dtype, auto meaning the compute dtype.
    Every pool (device, CPU swap, the draft model's, a TP rank's shard) is built from a spec with
    it, and every block move (swap, copy, KV transfer) copies those tensors, so all follow."""
    return getattr(torch, resolve_kv_cache_dtype(config.cache.cache_dtype, config.model.dtype))


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    # KV cache groups (more than one: a hybrid model); empty: one group of every layer
    groups: tuple[KVCacheGroupSpec, ...] = ()

    @property
    def num_groups(self) -> int:
        return max(len(self.groups), 1)

    @property
    def num_slots(self) -> int:
        """Layers one block id holds: every layer, or one group's."""
        return len(self.groups[0].layers) if self.groups else self.num_layers

    @property
    def layer_slots(self) -> list[int]:
        """Per model layer, the slot (tensor) holding its K/V."""
        if not self.groups:
            return list(range(self.num_layers))
        return [slot for _, slot in layer_slots(self.groups)]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across its slots, K and V."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.block_size * kv_bytes_per_token(self.num_slots, self.num_kv_heads,
                                                    self.head_dim, elem)

    def num_blocks_for(self, gib: float) -> int:
        return int(gib * GiB) // self.block_bytes


def kv_cache_spec(arch: ModelArchConfig, config, num_kv_heads: int) -> KVCacheSpec:
    """The KV cache of one worker: `num_kv_heads` are its own (a tensor-parallel rank's); KV
    cache groups when the configuration gives layer windows (`CacheConfig.layer_windows`)."""
    layer_windows = config.cache.layer_windows
    return KVCacheSpec(num_layers=arch.num_hidden_layers, num_kv_heads=num_kv_heads,
                       head_dim=arch.head_dim, block_size=config.cache.block_size,
                       dtype=kv_cache_torch_dtype(config),
                       groups=kv_cache_groups(layer_windows) if layer_windows else ())


class CacheEngine:
    def __init__(
        self, spec: KVCacheSpec, num_gpu_blocks: int, num_cpu_blocks: int, device: torch.device
    ):
        self.spec = spec
        self.device = device
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        shape = (spec.num_slots, 2, 0, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self._layer_slots = spec.layer_slots
        # zeros, not empty: padding slots are read (then masked) by decode attention, and garbage
        # could hold NaN/Inf that a mask does not neutralise in every kernel. On the CPU, on huge
        # pages: attention reads blocks from all over the pool (hugepages.py)
        self.gpu_cache = zeros_in_huge_pages(
            shape[:2] + (num_gpu_blocks,) + shape[3:], spec.dtype, device
        )
        self._views_of: torch.Tensor | None = None  # the tensor `kv_caches` views
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        pin = device.type == "cuda"
        # empty, not zeros: a swap block is read only after swap_out wrote it, and untouched pages
        # are not resident, so an idle engine does not hold its whole --swap-space in RAM
        self.cpu_cache = torch.empty(
            shape[:2] + (num_cpu_blocks,) + shape[3:],
            dtype=spec.dtype,
            device="cpu",
            pin_memory=pin,
        )

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per model layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim] (views
        of its slot). Built once per cache tensor: the 4 views a layer cost ~130 us a step for
        30 layers (2% of a batch-1 decode step of the default model). A draft model's cache that
        grows (spec_decode/draft_model.py) is a new tensor, so its views are rebuilt."""
        cache = self.gpu_cache
        if self._views_of is not cache:
            self._views = [(cache[j][0], cache[j][1]) for j in self._layer_slots]
            self._views_of = cache
        return self._views

    def swap_in(self, mapping: dict[int, int]) -> None:
        """CPU block -> device block, for every layer at once."""
        if mapping:
            src, dst = self._ids(mapping.keys(), "cpu"), self._ids(mapping.values(), self.device)
            moved = self.cpu_cache.index_select(2, src).to(self.device, non_blocking=True)
            self.gpu_cache.index_copy_(2, dst, moved)

    def swap_out(self, mapping: dict[int, int]) -> None:
        """Device block -> CPU block, for every layer at once."""
        if mapping:
            src, dst = self._ids(mapping.keys(), self.device), self._ids(mapping.values(), "cpu")
            self.cpu_cache.index_copy_(2, dst, self.gpu_cache.index_select(2, src).to("cpu"))

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Device block copies (copy-on-write). Sources are read before any destination is
        written."""
        if pairs:
            src = self._ids((s for s, _ in pairs), self.device)
            dst = self._ids((d for _, d in pairs), self.device)
            self.gpu_cache.index_copy_(2, dst, self.gpu_cache.index_select(2, src))

    @staticmethod
    def _ids(ids, device) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.long, device=device)
