"""The real server's logged steps (tessera/engine/step_log.py) as the simulator sees them, and the
serving rates fitted to them: what tessera/simulator/serving.py's module docstring says, and why
the fit is in seconds."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tessera.simulator.batch import BatchShape, batch_shape
from tessera.simulator.cost_model import SERVING_FEATURES, ProfiledCostModel, features
from tessera.simulator.fit import weighted_nnls

if TYPE_CHECKING:
    from tessera.simulator.trace import Step


@dataclasses.dataclass(frozen=True)
class LoggedStep:
    """One step of a real server's step log: its batch and how long the engine took over it."""

    batch: BatchShape
    seconds: float


def logged_batch(step: Step, block_bytes: int = 0) -> BatchShape:
    """The batch shape of a logged step; `block_bytes` (of one KV block) prices its swaps."""
    return batch_shape(((n, c) for _, n, c in step.reqs), step.swap_blocks * block_bytes,
                       step.num_shared_context_tokens)


def read_step_log(path: str, block_bytes: int | None = None) -> list[LoggedStep]:
    """The steps of a step log (tessera/engine/step_log.py), each priced as the simulator's
    clock advances (tessera/simulator/trace.py: start to the next start while the engine stayed
    busy, to its own end before idling). `block_bytes`: of one KV block, for the swap bytes
    (default: the log's own)."""
    from tessera.simulator.trace import read_trace

    trace = read_trace(path)
    size = trace.block_bytes if block_bytes is None else block_bytes
    return [LoggedStep(logged_batch(s, size), s.seconds) for s in trace.steps]


def step_kind(batch: BatchShape) -> str:
    if not batch.num_prefill_tokens:
        return "decode-only"
    return "prefill-only" if not batch.num_decode_tokens else "mixed"


def steps_by_kind(steps: list[LoggedStep], models: dict) -> dict[str, dict]:
    """Per kind of step (decode-only, prefill-only, mixed): how many, their real mean ms and each
    of `models`' (name -> CostModel) mean ms: where a cost model is off, step by step."""
    by_kind: dict[str, dict] = {}
    for s in steps:
        k = by_kind.setdefault(step_kind(s.batch),
                               {"steps": 0, "real_ms": 0.0, **{f"{m}_ms": 0.0 for m in models}})
        k["steps"] += 1
        k["real_ms"] += 1e3 * s.seconds
        for name, model in models.items():
            k[f"{name}_ms"] += 1e3 * model.step_time(s.batch)
    for k in by_kind.values():
        for key in k:
            if key.endswith("_ms"):
                k[key] = round(k[key] / k["steps"], 2)
    return by_kind


def fit_serving_rates(runner_profile: dict, steps: list[LoggedStep]) -> tuple[dict, dict]:
    """`SERVING_FEATURES` >= 0 so the runner-only profile plus them prices the logged steps
    (non-negative least squares in seconds), and the check `steps_by_kind` of the runner
    alone and with them."""
    if len(steps) < len(SERVING_FEATURES):
        raise ValueError(f"the step logs hold {len(steps)} steps; the serving fit needs at least "
                         f"{len(SERVING_FEATURES)}")
    runner = ProfiledCostModel(runner_profile)
    rows = [features(s.batch, SERVING_FEATURES) for s in steps]
    rates = weighted_nnls(rows, [s.seconds - runner.step_time(s.batch) for s in steps],
                          [1.0] * len(steps))
    terms = {name: float(r) for (name, _), r in zip(SERVING_FEATURES, rates, strict=True)}
    fitted = ProfiledCostModel({**runner_profile, **terms})
    return terms, steps_by_kind(steps, {"runner": runner, "fitted": fitted})
