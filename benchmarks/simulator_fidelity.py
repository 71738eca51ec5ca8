"""Fidelity of `tessera simulate`: the simulator with the profiled cost model against
the real server measured by `tessera bench serve`, on the same trace and flags.

    flock -x /work/cpu.lock .venv/bin/python benchmarks/simulator_fidelity.py \\
        [--profile profile.json] [--settings default chunked swap recompute prefix] [--repeat 3]

1. calibrate here (`tessera simulate calibrate`, bf16: the runner over a grid of shapes in two
   passes), unless --profile names a profile; then pick each trace's request rate: `--load`
   (default 0.5) of the capacity the runner-only profile simulates for it at rate inf with the
   setting's flags, so that every setting runs at half of its own capacity on any machine
   (`--load 0`: the fixed rates below, times `--rate-scale`);
2. `--repeat` rounds of real runs. Each round first runs the real server on the calibration
   trace (48 requests that are none of the traces below, with its step log), then every
   setting once: start `tessera serve` on 127.0.0.1 with the setting's engine flags, send the
   trace with `bench serve` (ignore_eos, so both sides produce the dataset's output lengths),
   stop the server. The serving overhead is then fitted to the calibration runs' logged steps
   (tessera/simulator/serving.py), and each setting simulated once (deterministic) on the same
   samples at the same arrival times with the same flags. Why the calibration runs are spread
   over the rounds: this machine's speed drifts by 10% and more within half an hour, and a serving
   fit made before the real runs (`--no-calibrate-between-rounds`: `simulate calibrate
   --serving-runs 3` first) carried the drift of its own minutes into every setting (decode
   steps priced 8-12% low in every setting of one run, within 3.6% in the run before it);
3. print a table of output throughput, median and p99 TTFT, median and p99 TPOT, the median of
   the real runs (and their spread) against simulated, with the relative error (target: <= 10%
   on throughput, median TTFT, median TPOT). One real run is not enough here: the same trace
   and flags gave a median TTFT of 196 and 251 ms in two runs of the chunked setting;
4. and step by step: every real server writes its engine step log (TESSERA_STEP_LOG), and each
   logged step is priced by the profile, by kind of step (decode-only, prefill-only, mixed);
5. with `--sensitivity`, each setting simulated again with every step 6% and 3% cheaper and
   dearer (the profile's runner and serving terms scaled): how much a setting's medians move
   for an error of the step prices, which the real runs' own drift between rounds exceeds.
   In one run here: recompute's median TPOT moved 8.79 / 9.36 / 10.30 / 11.03 / 11.67 ms at x0.94
   .. x1.06 (preemptions 9 .. 14), swap's 8.40 .. 10.20 (9 .. 12).

    python benchmarks/simulator_fidelity.py --real-results run.json --profile profile.json \
        --sensitivity   # no server: re-score an earlier run's measurements

Timing measurements on a 2-core machine: run it under the exclusive lock and nothing else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import tempfile
import time

from fidelity_rates import rates_at_load  # benchmarks/, beside this
from fidelity_sensitivity import format_sensitivity, sensitivity

from tessera.entrypoints.cli import build_parser, engine_args_from
from tessera.simulator.cli import load_samples, run_point
from tessera.simulator.cost_model import ProfiledCostModel
from tessera.simulator.serving import (
    TRACE_RATE,
    ServingRuns,
    median_run,
    real_server_metrics,
    runner_only,
)
from tessera.simulator.step_fit import read_step_log, steps_by_kind

RANDOM = ("--dataset random --random-input-len 256 --random-output-len 64 "
          "--random-range-ratio 0.5 --num-prompts 80")
# name -> (workload flags, engine flags, request rate with --load 0). The rates put the default
# server at about half of its capacity on a 2-core Zen 5 EPYC (~4.9 req/s on RANDOM, simulated
# at rate inf; 358 output tok/s measured at rate inf): near the knee a few percent of step-time
# error becomes a doubling of TTFT, which measures the knee's position, not the model. While the
# server's steps ran on a thread other than the one that loaded the model it was 2.3x slower per
# step (tessera/engine/engine_thread.py) and the rates were a quarter of these. They put the
# 64-block settings at 80-90% of theirs,
# hence --load.
SETTINGS = {
    "default": (RANDOM, "", 2.4),
    "chunked": (RANDOM, "--enable-chunked-prefill --max-num-batched-tokens 256", 2.4),
    # 64 blocks hold 1024 tokens, three requests of this trace: a few preemptions at this rate
    # (6-16 a run, measured). The engine refuses a cache that cannot hold one request of
    # --max-model-len, so these settings lower it (the longest request here is ~450 tokens).
    "swap": (RANDOM, "--num-gpu-blocks-override 64 --max-model-len 1024 --preemption-mode swap",
             2.4),
    "recompute": (RANDOM, "--num-gpu-blocks-override 64 --max-model-len 1024 "
                  "--preemption-mode recompute", 2.4),
    "prefix": ("--dataset prefix --prefix-len 512 --suffix-len 32 --random-output-len 64 "
               "--num-prompts 80", "--enable-prefix-caching", 4.4),
}
METRICS = (("output_throughput", "out tok/s"), ("median_ttft_ms", "med TTFT"),
           ("p99_ttft_ms", "p99 TTFT"), ("median_tpot_ms", "med TPOT"),
           ("p99_tpot_ms", "p99 TPOT"))
TARGETS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="reuse this profile (skip calibration)")
    parser.add_argument("--grid", default="small", help="calibration grid")
    parser.add_argument("--serving-requests", type=int, default=48,
                        help="requests of the serving-overhead calibration (0: runner only)")
    parser.add_argument("--serving-runs", type=int, default=3,
                        help="real-server runs of the serving-overhead calibration, with "
                             "--no-calibrate-between-rounds (otherwise one before each round)")
    parser.add_argument("--calibrate-between-rounds", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="fit the serving overhead to calibration-trace runs made before "
                             "each round (the same minutes as the runs it predicts); with "
                             "--no-calibrate-between-rounds, to runs made by the calibration")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--repeat", type=int, default=3,
                        help="real-server runs per setting, interleaved across settings; the "
                             "table compares the simulation with their median")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the engine's --dtype on both sides (float32 on a CPU without "
                             "AVX-512, where bf16 has no fast path)")
    parser.add_argument("--load", type=float, default=0.5,
                        help="send each trace (every setting's and the calibration trace's) "
                             "at this fraction of its own capacity here: the request rate the "
                             "runner-only profile simulates at rate inf with the setting's "
                             "flags (default %(default)s); 0: the fixed rates of SETTINGS "
                             "times --rate-scale")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="with --load 0, multiply every setting's request rate (and the "
                             "calibration trace's): the rates are ~50%% of the default "
                             "setting's capacity on a 2-core Zen 5 EPYC")
    parser.add_argument("--sensitivity", action="store_true",
                        help="also simulate each setting with every step priced x0.94, x0.97, "
                             "x1.03 and x1.06: how far the medians move for a small error of "
                             "the step prices")
    parser.add_argument("--result-file", default=None, help="write all figures as JSON")
    parser.add_argument("--real-results", default=None, metavar="JSON",
                        help="take the real runs (and their step logs) from this earlier "
                             "--result-file instead of starting servers: scores another "
                             "--profile against the same measurements")
    args = parser.parse_args()
    common = f"--dtype {args.dtype}"
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    work = tempfile.mkdtemp(prefix="tessera-fidelity-")
    t0 = time.perf_counter()
    profile = args.profile
    between_rounds = (args.calibrate_between_rounds and not args.real_results
                      and args.serving_requests > 0)
    trace_rate = args.rate_scale * TRACE_RATE  # the calibration trace's, until --load sets it
    cal = build_parser().parse_args(["simulate", "calibrate", *shlex.split(common),
                                     "--serving-request-rate", str(trace_rate),
                                     "--grid", args.grid, "--output",
                                     os.path.join(work, "profile.json"),
                                     "--serving-requests",
                                     str(0 if between_rounds else args.serving_requests),
                                     "--serving-runs", str(args.serving_runs)])
    if profile is None:
        cal.func(cal)
        profile = cal.output
    print(f"profile: {profile} ({time.perf_counter() - t0:.0f} s so far)", flush=True)
    rates = {name: SETTINGS[name][2] * args.rate_scale for name in args.settings}
    if args.load > 0 and not args.real_results:
        workloads = {name: (SETTINGS[name][0], f"{common} {SETTINGS[name][1]}")
                     for name in args.settings}
        rates, trace_rate = rates_at_load(profile, workloads, args.load, common, work,
                                          args.serving_requests if between_rounds else None,
                                          trace_rate)
    serving = (ServingRuns(engine_args_from(cal), args.serving_requests, trace_rate)
               if between_rounds else None)
    rows: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {name: [] for name in args.settings}
    step_logs: dict[str, list[str]] = {name: [] for name in args.settings}

    def point(name: str, profile_path: str | None = None):
        """The setting's simulate arguments (with `profile_path`, default the run's profile),
        samples and request rate here."""
        workload, engine_flags, rate = SETTINGS[name]
        ns = build_parser().parse_args(["simulate", *shlex.split(workload),
                                        *shlex.split(f"{common} {engine_flags}"),
                                        "--profile", profile_path or profile, "--quiet"])
        return ns, load_samples(ns), rates[name]

    if args.real_results:
        with open(args.real_results, encoding="utf-8") as f:
            earlier = json.load(f)
        for name in args.settings:
            row = earlier["rows"][name]
            rates[name] = row["rate"]  # simulate at the rates the real runs were sent at
            runs[name] = row["real_runs"]
            # older result files kept no paths: the logs lie beside their profile
            step_logs[name] = row.get("step_logs") or [
                os.path.join(os.path.dirname(earlier["profile"]),
                             f"server-{name}-{rep}.steps.jsonl") for rep in range(len(runs[name]))]
    for name in args.settings:
        workload, flags, _ = SETTINGS[name]
        rows[name] = {"flags": flags, "workload": workload, "rate": rates[name]}
    # repetition-major: each round runs every setting once, so a drift of this machine's speed
    # over the run lands on every setting alike instead of on the last ones
    for rep in range(0 if args.real_results else args.repeat):
        if serving is not None:
            serving.run()
        for name in args.settings:
            ns, samples, rate = point(name)
            step_log = os.path.join(work, f"server-{name}-{rep}.steps.jsonl")
            real = real_server_metrics(shlex.split(f"{common} {SETTINGS[name][1]}"), samples,
                                       rate, ns.seed, work, f"server-{name}-{rep}",
                                       step_log=step_log)
            step_logs[name].append(step_log)
            runs[name].append(real)
            print(f"{name} (run {rep + 1}/{args.repeat}): real {real['output_throughput']:.1f} "
                  f"tok/s, median TTFT {real['median_ttft_ms']:.0f} ms, median TPOT "
                  f"{real['median_tpot_ms']:.1f} ms ({time.perf_counter() - t0:.0f} s so far; "
                  f"failed {real['failed']}, preemptions {real['num_preemptions']})", flush=True)
    if serving is not None:
        with open(profile, encoding="utf-8") as f:
            runner = runner_only(json.load(f))
        profile = os.path.join(work, "profile-serving.json")
        with open(profile, "w", encoding="utf-8") as f:
            json.dump({**runner, **serving.fit(runner)}, f, indent=2)
        print(f"profile with the serving overhead of {len(serving.real_runs)} calibration runs "
              f"between the rounds: {profile}", flush=True)
    for name in args.settings:
        ns, samples, rate = point(name)
        rows[name]["sim"] = run_point(ns, samples, rate, include_requests=False)["metrics"]
    if args.sensitivity:
        def simulate(name: str, profile_path: str) -> dict:
            ns, samples, rate = point(name, profile_path)
            return run_point(ns, samples, rate, include_requests=False)["metrics"]

        for name, by_scale in sensitivity(profile, args.settings, work, simulate).items():
            rows[name]["sensitivity"] = by_scale
    model = ProfiledCostModel.load(profile)
    block_bytes = model.geometry.block_bytes(16)  # no setting changes --block-size
    for name, real_runs in runs.items():
        rows[name]["real"] = median_run(real_runs)
        rows[name]["real_runs"] = real_runs
        rows[name]["step_logs"] = step_logs[name]
        # the check step by step: every logged step of the real runs, priced by the profile
        steps = [st for path in step_logs[name] for st in read_step_log(path, block_bytes)]
        rows[name]["steps_by_kind"] = steps_by_kind(steps, {"model": model})
    if args.result_file:  # first: the figures outlive a bug in the printing below
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump({"profile": profile, "load": None if args.real_results else args.load,
                       "calibration_trace_rate": trace_rate, "rows": rows}, f, indent=2)
    print()
    print(f"real = the median of {len(next(iter(runs.values())))} server runs per setting; "
          "spread = their (max - min) / median")
    header = (f"{'setting':<10} {'metric':<10} {'real':>9} {'spread':>7} {'sim':>9} "
              f"{'error':>8}")
    print(header)
    print("-" * len(header))
    worst = 0.0
    for name, row in rows.items():
        for key, label in METRICS:
            real, sim = row["real"][key], row["sim"][key]
            err = (sim - real) / real if real else float("nan")
            if key in TARGETS:
                worst = max(worst, abs(err))
            mark = " *" if key in TARGETS and abs(err) > 0.10 else ""
            values = [r[key] for r in row["real_runs"]]
            spread = (max(values) - min(values)) / real if real else float("nan")
            print(f"{name:<10} {label:<10} {real:9.1f} {100 * spread:6.1f}% {sim:9.1f} "
                  f"{100 * err:+7.1f}%{mark}")
        print(f"{name:<10} {'failed':<10} {row['real']['failed']:9d} {row['sim']['failed']:9d}")
        real_pre = row["real"].get("num_preemptions")
        print(f"{name:<10} {'preempt':<10} {real_pre if real_pre is not None else '?':>9} "
              f"{row['sim']['num_preemptions']:9d}")
    print("\nwhere TTFT goes (means, ms): the client's TTFT = latency outside the engine + the "
          "engine's TTFT (queue + prefill), real (server histograms) / simulated")
    print(f"{'setting':<10} {'client':>13} {'outside':>13} {'engine':>13} {'queue':>13} "
          f"{'prefill':>13}")
    for name, row in rows.items():
        real, sim = row["real"], row["sim"]
        rs, se = real.get("server", {}), sim.get("engine_clock", {})

        def pair(a, b):
            return f"{a:6.0f}/{b:<6.0f}" if a is not None and b is not None else f"{'?':>13}"

        outside_real = real["mean_ttft_ms"] - rs["mean_ttft_ms"] if rs else None
        outside_sim = sim["mean_ttft_ms"] - se["mean_ttft_ms"] if se else None
        print(f"{name:<10} {pair(real['mean_ttft_ms'], sim['mean_ttft_ms'])} "
              f"{pair(outside_real, outside_sim)} "
              f"{pair(rs.get('mean_ttft_ms'), se.get('mean_ttft_ms'))} "
              f"{pair(rs.get('mean_queue_ms'), se.get('mean_queue_ms'))} "
              f"{pair(rs.get('mean_prefill_ms'), se.get('mean_prefill_ms'))}")
    print("\nstep by step: the real servers' logged steps (all runs) against the profile's "
          "price of each, mean ms per step")
    print(f"{'setting':<10} {'kind':<13} {'steps':>6} {'real':>8} {'model':>8} {'error':>8}")
    for name, row in rows.items():
        for kind, k in sorted(row["steps_by_kind"].items()):
            err = (k["model_ms"] - k["real_ms"]) / k["real_ms"]
            print(f"{name:<10} {kind:<13} {k['steps']:6d} {k['real_ms']:8.1f} "
                  f"{k['model_ms']:8.1f} {100 * err:+7.1f}%")
    if args.sensitivity:
        print("\n" + format_sensitivity(rows))
    print(f"\nworst error on throughput / median TTFT / median TPOT: {100 * worst:.1f}% "
          f"(target 10%; * marks a miss); total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
