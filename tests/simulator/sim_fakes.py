"""A cost model with known step times, for tests that check the virtual clock."""

from __future__ import annotations

from tessera.simulator.batch import BatchShape
from tessera.simulator.cost_model import CostModel, KVGeometry


class FixedCost(CostModel):
    """`per_step` seconds per step plus `per_token` per scheduled token; swaps cost
    `per_swap_byte`. KV geometry of a 1-layer model with 1 head of 8 dims, fp32."""

    name = "fixed"

    def __init__(self, per_step: float = 0.01, per_token: float = 0.0,
                 per_swap_byte: float = 0.0, max_model_len: int = 512) -> None:
        self.per_step, self.per_token, self.per_swap_byte = per_step, per_token, per_swap_byte
        self.geometry = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, elem_size=4)
        self.max_model_len = max_model_len
        self.batches: list[BatchShape] = []

    def compute_time(self, batch: BatchShape) -> float:
        self.batches.append(batch)
        return self.per_step + self.per_token * batch.num_tokens if batch.num_tokens else 0.0

    def swap_time(self, batch: BatchShape) -> float:
        return batch.swap_bytes * self.per_swap_byte


def step_log_lines(steps, start: float = 100.0) -> list[str]:
    """A step log (tessera/engine/step_log.py) of (reqs, seconds) steps, `reqs` as
    [new, computed] pairs, run back to back from `start`; each step ends at 90% of its time and
    the last one leaves the engine idle. No arrivals: enough for step pricing, not a replay."""
    import json

    from tessera.engine.step_log import FORMAT, FORMAT_VERSION

    lines = [json.dumps({"type": "header", "format": FORMAT, "version": FORMAT_VERSION,
                         "model": "fake", "num_gpu_blocks": 64, "num_cpu_blocks": 0,
                         "block_bytes": 64, "scheduler": {}, "cache": {}})]
    t = start
    for i, (reqs, seconds) in enumerate(steps):
        lines.append(json.dumps({
            "type": "step", "step": i, "start": t, "end": t + 0.9 * seconds,
            "busy": i < len(steps) - 1, "num_seqs": len(reqs),
            "num_tokens": sum(n for n, _ in reqs),
            "reqs": [[f"r{k}", n, c] for k, (n, c) in enumerate(reqs)], "preempted": [],
            "ignored": [], "swap_out": 0, "swap_in": 0, "tokens": {}, "finished": {}}))
        t += seconds
    return lines
