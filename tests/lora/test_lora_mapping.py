"""The step's LoRA segments from its (adapter, rows) runs: neighbours of one adapter merged, the
base model's rows left out, empty runs skipped."""

from __future__ import annotations

from tessera.lora.mapping import row_segments


def test_runs_become_merged_segments_without_the_base_model():
    runs = [(2, 1), (2, 1), (0, 3), (1, 1), (1, 0), (1, 5), (3, 4), (0, 1), (3, 2)]
    assert row_segments(runs) == [(0, 2, 2), (5, 11, 1), (11, 15, 3), (16, 18, 3)]
    assert row_segments([(0, 7)]) == []
    assert row_segments([]) == []
    assert row_segments([(4, 0), (4, 3)]) == [(0, 3, 4)]
