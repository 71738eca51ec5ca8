"""KV cache groups: how a model whose layers mix sliding-window and full attention (Gemma 2/3) lays
out its cache so that a local layer does not hold a full-length table's worth of memory (vLLM v1's
hybrid allocator, `KVCacheGroupSpec`).

Layers are split by attention type (full, or each window size) into groups of equal size, the
greatest common divisor of the per-type layer counts. Every group draws block ids from ONE shared
pool, and the cache is `group_size` tensors, tensor j holding layer j of every group: one block id
is the KV of `group_size` layers (one per tensor), so a block is `num_groups` times smaller than a
block of all layers, and the pool has `num_groups` times more of them for the same memory.

    Gemma 3 270M: 18 layers, 3 global (5, 11, 17) + 15 local (window 512); group size gcd(3, 15) = 3

    group 0  full     layers  5, 11, 17       tensor 0 holds layers 5, 0, 3, 7, 10, 14 (the
    group 1  window   layers  0,  1,  2       first of every group), tensor 1 layers 11, 1, 4,
    group 2  window   layers  3,  4,  6       ...; block id b is row b of all three tensors, so
    ...                                       it holds 3 layers' KV for ONE group's table
    group 5  window   layers 14, 15, 16

Each sequence has a block table per group (core/block_layout.py: kept interleaved in one
list). A window group keeps only the blocks its window still needs, so at decode time a long
request costs `len` blocks in each full group and about `window / block_size + 1` in each window
group, instead of `len` blocks of every layer.

Why the gcd and not vLLM's padded groups: no tensor slot is ever padding, and for the models we
serve the number of groups stays small (Gemma 3 270M: 6; Gemma 2: 2). Full-attention groups come
first, so group 0 is a full group whenever the model has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its layers' window (None: full attention) and its layers, in the order of the
    cache's tensors (layer `layers[j]` lives in tensor j)."""

    window: int | None
    layers: tuple[int, ...]


def kv_cache_groups(layer_windows: Sequence[int | None]) -> tuple[KVCacheGroupSpec, ...]:
    """The groups of a model whose layer i attends within `layer_windows[i]` (None: all keys).
    One group holding every layer when all windows are equal (today's layout: Llama, Mistral)."""
    if not layer_windows:
        raise ValueError("layer_windows must name at least one layer")
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if window is not None and window < 1:
            raise ValueError(f"layer_windows[{layer}] must be >= 1 or None, got {window}")
        by_window.setdefault(window, []).append(layer)
    if len(by_window) == 1:
        ((window, layers),) = by_window.items()
        return (KVCacheGroupSpec(window, tuple(layers)),)
    size = 0
    for layers in by_window.values():
        size = gcd(size, len(layers))
    # full attention first, then windows from the smallest
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return tuple(
        KVCacheGroupSpec(window, tuple(by_window[window][i : i + size]))
        for window in order
        for i in range(0, len(by_window[window]), size)
    )


def layer_slots(groups: Sequence[KVCacheGroupSpec]) -> list[tuple[int, int]]:
    """Per model layer, (its group, its tensor): where its K/V live."""
    slots: dict[int, tuple[int, int]] = {}
    for g, spec in enumerate(groups):
        for j, layer in enumerate(spec.layers):
            slots[layer] = (g, j)
    return [slots[layer] for layer in range(len(slots))]


def group_windows(layer_windows: Sequence[int | None]) -> tuple[int | None, ...]:
    """Each group's window, for the block manager (empty when no layer windows are given: the
    single-group layout, whose window is `CacheConfig.sliding_window`)."""
    if not layer_windows:
        return ()
    return tuple(spec.window for spec in kv_cache_groups(layer_windows))


def cache_group_windows(sliding_window: int | None,
                        layer_windows: Sequence[int | None]) -> tuple[int | None, ...]:
    """Each KV cache group's window as the block manager keeps it: the groups' of mixed
    `layer_windows` (`CacheConfig.layer_windows`), else one group with `sliding_window`
    (`CacheConfig.sliding_window`, None: full attention)."""
    return group_windows(layer_windows) or (sliding_window,)


def num_pool_blocks_for_override(num_gpu_blocks_override: int,
                                 layer_windows: Sequence[int | None]) -> int:
    """Pool blocks for --num-gpu-blocks-override. The flag counts blocks of every layer (the
    memory it has always meant); with KV cache groups a pool block holds one group's layers, so
    each is `num_groups` pool blocks. The engine's sizing and the simulator's both ask this."""
    num_groups = len(kv_cache_groups(layer_windows)) if layer_windows else 1
    return num_gpu_blocks_override * num_groups
