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


def row_segments(runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(adapter id, number of rows) runs in flat-batch order -> segments (start, end, id), equal
    neighbours merged, id 0 (the base model) left out. One entry per request, not per row."""
    segments: list[tuple[int, int, int]] = []
    row = 0
    for lid, n in runs:
        if lid and segments and segments[-1][1] == row and segments[-1][2] == lid:
            segments[-1] = (segments[-1][0], row + n, lid)
        elif lid and n:
            segments.append((row, row + n, lid))
        row += n
    return segments
