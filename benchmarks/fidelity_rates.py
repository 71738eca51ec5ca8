"""The request rates of benchmarks/simulator_fidelity.py's `--load`: each trace at a fraction of
its own capacity, simulated on the calibrated runner-only profile."""

from __future__ import annotations

import json
import math
import os
import shlex

from tessera.entrypoints.cli import build_parser
from tessera.simulator.cli import load_samples, run_point
from tessera.simulator.serving import TRACE, runner_only


def trace_capacity(workload: str, flags: str, profile: str) -> float:
    """Requests per second the simulator serves `workload` at with `flags` when every request
    arrives at once: the trace's capacity under that profile."""
    ns = build_parser().parse_args(["simulate", *shlex.split(workload), *shlex.split(flags),
                                    "--profile", profile, "--quiet"])
    metrics = run_point(ns, load_samples(ns), math.inf, include_requests=False)["metrics"]
    return metrics["request_throughput"]


def rates_at_load(profile: str, workloads: dict[str, tuple[str, str]], load: float, common: str,
                  work: str, serving_requests: int | None,
                  trace_rate: float) -> tuple[dict[str, float], float]:
    """Each setting's request rate at `load` of its own capacity (`workloads`: name ->
    (workload flags, engine flags)), and the calibration trace's of `serving_requests` requests
    (None: calibrate already ran it, without --calibrate-between-rounds, at `trace_rate`).

    Why per setting: one rate for all put the default at half its capacity and a 64-block
    cache at 80-90% of its own (in one run: 2.89 against 1.63-1.83 req/s simulated at rate inf),
    at the knee, where the three real runs' median TTFTs spread by 237% and a few percent of
    step price becomes a doubling of TTFT. Why the runner-only prices: they exist before any
    real run (the serving overhead is fitted to runs made in the rounds), and they make every
    capacity a few percent high alike."""
    with open(profile, encoding="utf-8") as f:
        runner = runner_only(json.load(f))
    runner_path = os.path.join(work, "profile-runner-only.json")
    with open(runner_path, "w", encoding="utf-8") as f:
        json.dump(runner, f)
    rates = {}
    for name, (workload, flags) in workloads.items():
        capacity = trace_capacity(workload, flags, runner_path)
        rates[name] = round(load * capacity, 3)
        print(f"{name}: capacity {capacity:.2f} req/s simulated, sent at {rates[name]} req/s",
              flush=True)
    if serving_requests is not None:
        trace = (f"--dataset {TRACE['dataset']} --random-input-len {TRACE['random_input_len']} "
                 f"--random-output-len {TRACE['random_output_len']} --random-range-ratio "
                 f"{TRACE['random_range_ratio']} --num-prompts {serving_requests}")
        capacity = trace_capacity(trace, common, runner_path)
        trace_rate = round(load * capacity, 3)
        print(f"calibration trace: capacity {capacity:.2f} req/s simulated, sent at "
              f"{trace_rate} req/s", flush=True)
    return rates, trace_rate
