"""A JSON-lines log of every engine step, switched on by `TESSERA_STEP_LOG=<path>`.

Why: `tessera simulate calibrate` times the runner alone, and behind `tessera serve` a step also
pays for what runs around the runner on the same cores (output processing, the event loop, the
benchmark client). The calibration runs the real server with this log on and fits that overhead
to the real step intervals (tessera/simulator/serving.py), so the simulator is held to each step
rather than to end-to-end means.

One line per step: `start` and `end` (seconds, `time.perf_counter`), `busy` (the engine still had
work after it, so the next step started at once), `reqs` (each scheduled request's [new tokens,
computed tokens before the step]) and `swap_blocks` (blocks moved out and in).
"""

from __future__ import annotations

import json
import os

from tessera.core.scheduler_output import SchedulerOutput

ENV_VAR = "TESSERA_STEP_LOG"


class StepLog:
    def __init__(self, path: str) -> None:
        # line-buffered: a server stopped by a signal keeps every step it logged
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    @classmethod
    def from_env(cls) -> StepLog | None:
        path = os.environ.get(ENV_VAR)
        return cls(path) if path else None

    def record(self, out: SchedulerOutput, start: float, end: float, busy: bool) -> None:
        computed = out.num_computed_tokens_by_req()
        reqs = [[n, computed[r]] for r, n in out.num_scheduled_tokens.items()]
        swap = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        self._file.write(json.dumps({"start": start, "end": end, "busy": busy, "reqs": reqs,
                                     "swap_blocks": swap}, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
