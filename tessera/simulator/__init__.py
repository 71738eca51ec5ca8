"""`tessera simulate`: the real scheduler (tessera/core) on a virtual clock, with a cost model for
the time each step takes. Capacity planning at scales this machine cannot run, without a second
scheduler to keep in step with the first.

- `batch`: the synthetic runner (a `BatchShape` per step, synthetic tokens; spec-decode seam)
- `cost_model`: the step-time interface (with the all-reduce and KV-transfer seams) and the
  profiled model; `roofline`: the analytical one; `specs`: hardware specs and model configs
  shipped as package data (data/)
- `simulator`: the loop; `report`: bench serve's metrics and JSON, the timeline figure
- `calibrate`: `tessera simulate calibrate`, timing the real runner and fitting a profile
- `cli`: the flags (bench serve's dataset flags, every engine flag, the cost model's)

Heavy modules load only when a subcommand runs, so `tessera --help` stays fast.
"""

from __future__ import annotations


def add_simulate_parser(subparsers) -> None:
    from tessera.simulator.cli import add_simulate_parser as add

    add(subparsers)
