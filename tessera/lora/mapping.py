"""`LoRAMapping`: which rows of a step's flat batch run under which adapter slot, built once per
step by the worker and carried to the model in the step's `AttentionMetadata` (never a global);
every layer's projections reuse it.

The runner orders the batch so that each adapter's rows are contiguous within the decodes and
within the prompt chunks (the attention backend only needs decodes before chunks), so an adapter
owns at most two row segments and each LoRA product runs over a slice of rows, with no gather or
scatter (tessera/model/lora_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRAMapping:
    """segments: (first row, end row, bank slot), in row order, rows of the base model
    (adapter 0) left out; table: the same as an int64 [S, 3] host tensor (the kernel's input);
    bank: the engine's `tessera.model.lora_layers.LoRABank` whose slots the segments name."""

    segments: list[tuple[int, int, int]]
    table: Any
    bank: Any

    def __bool__(self) -> bool:
        return bool(self.segments)


def row_segments(row_ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal ids in `row_ids` (one id per row) as (start, end, id), id 0 left out."""
    segments: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(row_ids) + 1):
        if i == len(row_ids) or row_ids[i] != row_ids[start]:
            if row_ids[start]:
                segments.append((start, i, row_ids[start]))
            start = i
    return segments
