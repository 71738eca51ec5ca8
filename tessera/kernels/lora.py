"""Batched LoRA deltas over a step's adapter segments (lora.cpp), with the torch reference that
serves devices and builds without the kernel.

`lora_add_(y, x, segments, a, bt, ranks, out_offsets)` adds, in place, for each segment
(start, end, slot) and each target t of a projection,

    y[start:end, out_offsets[t]:out_offsets[t + 1]] += (x[start:end] @ A_t^T) @ B_t^T

where A_t^T is `a[slot, :, t * R : t * R + ranks[slot, t]]` and B_t^T the same ranks' rows of
target t's block of `bt[slot]` (layout in lora.cpp's header; built by tessera/model/lora_layers.py).
One call per projection and layer, whatever the number of adapters in the step: as torch calls,
every segment cost four calls per projection and layer.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from tessera.kernels.build import VEC_HEADER, load_extension

_SOURCE = Path(__file__).with_name("lora.cpp")


def lora_kernel_for(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The compiled module when it serves tensors of this device and dtype, else None."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    return load_extension("tessera_lora", _SOURCE, depends=(VEC_HEADER,))


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, segments: list[tuple[int, int, int]],
                       a: torch.Tensor, bt: torch.Tensor, ranks: list[list[int]],
                       out_offsets: list[int]) -> None:
    """The same sums as the kernel in torch ops, one shrink and one expand per segment and
    target (`segments`, `ranks` and `out_offsets` as Python lists: no device sync)."""
    num_targets = len(out_offsets) - 1
    max_rank = a.shape[2] // num_targets
    for start, end, slot in segments:
        rows = x[start:end].to(a.dtype)  # [m, K]
        for t in range(num_targets):
            rank = ranks[slot][t]
            if rank == 0:
                continue
            o0, o1 = out_offsets[t], out_offsets[t + 1]
            a_t = a[slot, :, t * max_rank : t * max_rank + rank]  # [K, rank]
            bt_t = bt[slot, max_rank * o0 : max_rank * o1].view(max_rank, o1 - o0)[:rank]
            delta = (rows @ a_t) @ bt_t  # [m, rank] -> [m, out_t]
            out = y[start:end, o0:o1]
            out.copy_(out.to(delta.dtype) + delta)  # added in fp32, rounded once, as the kernel
