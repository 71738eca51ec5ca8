"""Fidelity of `tessera simulate`, checked inside one run so that a noisy machine can verify it.

    flock -x /work/cpu.lock .venv/bin/python benchmarks/simulator_fidelity.py \\
        [--settings default chunked swap recompute prefix] [--result-file fidelity.json]

Three checks, on the five settings (default; chunked prefill, budget 256; a 64-block cache with
swap; the same with recompute; prefix caching on a shared-prefix trace):

1. **Replay.** Each real server runs with `--step-log`; its log is replayed through the real
   scheduler with the logged step times (`tessera simulate --replay`). Target: the same
   schedule step by step, the same preemptions, every request's TTFT and E2E within 5% or
   20 ms. Beside it, what the replay cannot see: the client's mean TTFT less the engine's
   (HTTP, tokenizing, SSE, the client's parsing).
2. **Step prices, fitted beside the run they price.** The run alternates probes with the real
   settings: probe, setting A, probe, setting B, ... A probe is one pass of the real runner
   over the `small` grid of batch shapes (in this process, the model loaded once) and the
   probe trace (16 requests) sent to the next and the previous server, before and after its
   setting's trace. Each setting's logged steps are priced by the profile fitted to the grid
   passes on either side of it, plus the serving overhead fitted to the probe traces on
   either side (tessera/simulator/serving.py), and the error |pred - real| / real is reported
   per setting and per kind of step (median, p90). Target: median <= 10%, p90 <= 25%. The
   machine's drift between the two probes (the grid's median ratio of shape times, and the
   probe traces' median step time) is printed; a setting whose probes differ by more than
   `--drift-limit` (10%) is flagged unmeasurable rather than counted as a miss.
3. **End to end.** Each setting simulated (the profiled cost model of (2), the same samples,
   arrival times and flags) against the real trace's throughput and median/p99 TTFT and
   TPOT, with the drift beside it. No target.

Each trace is sent at `--load` (0.5) of its capacity as the first probe's runner-only profile
simulates it at rate inf. Default: 32 requests a setting; the default and chunked settings took
~40 s each here, and a run with other processes on the same cores took 25 minutes. Timing on a
2-core machine: run it under the exclusive lock and nothing else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import sys
import tempfile
import time

from fidelity_rates import rates_at_load  # benchmarks/, beside this

from tessera.bench import datasets
from tessera.bench.config import BenchConfig
from tessera.bench.serve import load_bench_tokenizer, run_bench
from tessera.bench.sweep import ServerProcess, free_port
from tessera.config import EngineArgs
from tessera.entrypoints.cli import build_parser
from tessera.simulator.calibrate import GridProbe
from tessera.simulator.cli import load_samples, run_point
from tessera.simulator.cost_model import ProfiledCostModel
from tessera.simulator.replay import compare, real_request_times, replay
from tessera.simulator.serving import TRACE
from tessera.simulator.step_fit import LoggedStep, fit_serving_rates, logged_batch, step_kind
from tessera.simulator.trace import read_trace

RANDOM = ("--dataset random --random-input-len 256 --random-output-len 64 "
          "--random-range-ratio 0.5 --num-prompts {n}")
# name -> (workload flags, engine flags). 64 blocks hold 1024 tokens, three requests of RANDOM:
# the engine preempts. It refuses a cache that cannot hold one --max-model-len request, so those
# settings lower it (the longest request here is ~450 tokens).
SETTINGS = {
    "default": (RANDOM, ""),
    "chunked": (RANDOM, "--enable-chunked-prefill --max-num-batched-tokens 256"),
    "swap": (RANDOM, "--num-gpu-blocks-override 64 --max-model-len 1024 --preemption-mode swap"),
    "recompute": (RANDOM, "--num-gpu-blocks-override 64 --max-model-len 1024 "
                  "--preemption-mode recompute"),
    "prefix": ("--dataset prefix --prefix-len 512 --suffix-len 32 --random-output-len 64 "
               "--num-prompts {n}", "--enable-prefix-caching"),
}
METRICS = (("output_throughput", "out tok/s"), ("median_ttft_ms", "med TTFT"),
           ("p99_ttft_ms", "p99 TTFT"), ("median_tpot_ms", "med TPOT"),
           ("p99_tpot_ms", "p99 TPOT"))


def quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))] if v else float("nan")


def send(base_url: str, samples, rate: float, seed: int) -> tuple[dict, float, float]:
    """bench serve's metrics for `samples` at `rate` (ignore_eos), and the phase's start and
    end on the step log's clock (perf_counter is the system's monotonic clock here)."""
    start = time.perf_counter()
    cfg = BenchConfig(base_url=base_url, request_rate=rate, seed=seed, ignore_eos=True,
                      disable_tqdm=True)
    metrics = run_bench(cfg, samples, load_bench_tokenizer(None), quiet=True)["metrics"]
    return metrics, start, time.perf_counter()


def serve_setting(flags: str, phases, log: str, work: str, label: str) -> list:
    """Start `tessera serve` with `flags` and its step log, send each (samples, rate, seed) of
    `phases` in turn, stop it; each phase's `send` result."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tessera.entrypoints.cli", "serve", "--port", str(port),
            "--step-log", log, *shlex.split(flags)]
    with ServerProcess(argv, url, os.path.join(work, f"{label}.log"), 900.0):
        return [send(url, samples, rate, seed) for samples, rate, seed in phases]


def in_window(trace, start: float, end: float):
    """The trace's steps and requests that began in [start, end)."""
    steps = [s for s in trace.steps if start <= s.start < end]
    arrivals = {a.request_id for a in trace.arrivals if start <= a.time < end}
    return steps, arrivals


def logged_steps(steps, block_bytes: int) -> list[LoggedStep]:
    return [LoggedStep(logged_batch(s, block_bytes), s.seconds) for s in steps]


def kind(step: LoggedStep) -> str:
    return "with-swap" if step.batch.swap_bytes else step_kind(step.batch)


def engine_ttft_ms(trace, request_ids: set[str]) -> float:
    """The engine's mean TTFT of `request_ids` (from the server's arrival to the end of the step
    with the first token), leaving out bench serve's short test request before each trace."""
    first, _, num_tokens = real_request_times(trace)
    arrival = {a.request_id: a.arrival_time for a in trace.arrivals}
    ttfts = [first[r] - arrival[r] for r in request_ids if r in first and num_tokens[r] > 4]
    return 1e3 * statistics.mean(ttfts) if ttfts else float("nan")


def grid_drift(before: dict, after: dict) -> float:
    """The median over shapes of (time after / time before) - 1."""
    return statistics.median(statistics.median(after[s]) / statistics.median(before[s])
                             for s in before) - 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per setting")
    parser.add_argument("--probe-requests", type=int, default=16,
                        help="requests of each probe trace (serving overhead)")
    parser.add_argument("--grid", default="small", help="the probes' grid of batch shapes")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per shape a probe")
    parser.add_argument("--model", default=None,
                        help="the model on both sides (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="--dtype on both sides (float32 on a CPU without AVX-512)")
    parser.add_argument("--load", type=float, default=0.5,
                        help="send each trace at this fraction of its simulated capacity")
    parser.add_argument("--drift-limit", type=float, default=0.10,
                        help="neighbouring probes further apart than this flag the setting "
                             "unmeasurable (default %(default)s)")
    parser.add_argument("--result-file", default=None, help="write all figures as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="tessera-fidelity-")
    common = f"--dtype {args.dtype}"
    model_flag = f"--model {shlex.quote(args.model)} " if args.model else ""
    grid = GridProbe(EngineArgs(model=args.model, dtype=args.dtype), args.grid, args.repeats)
    passes = [grid.time_pass()]
    runner0 = os.path.join(work, "profile-probe0.json")
    with open(runner0, "w", encoding="utf-8") as f:
        json.dump(grid.profile(passes), f)
    workloads = {name: (SETTINGS[name][0].format(n=args.num_prompts),
                        f"{common} {SETTINGS[name][1]}") for name in args.settings}
    rates, probe_rate = rates_at_load(runner0, workloads, args.load, common, work,
                                      args.probe_requests, 1.0)
    tok = load_bench_tokenizer(None)
    probe_samples = datasets.sample_random(tok, args.probe_requests, TRACE["random_input_len"],
                                           TRACE["random_output_len"],
                                           TRACE["random_range_ratio"], seed=1)
    rows: dict[str, dict] = {}
    for name in args.settings:
        workload, flags = workloads[name]
        ns = build_parser().parse_args(["simulate", *shlex.split(workload), *shlex.split(flags),
                                        "--profile", runner0, "--quiet"])
        samples = load_samples(ns)
        log = os.path.join(work, f"{name}.steps.jsonl")
        phases = serve_setting(
            model_flag + flags,
            [
                (probe_samples, probe_rate, 1),
                (samples, rates[name], ns.seed),
                (probe_samples, probe_rate, 1),
            ],
            log,
            work,
            name,
        )
        passes.append(grid.time_pass())
        rows[name] = {
            "flags": flags,
            "workload": workload,
            "rate": rates[name],
            "log": log,
            "phases": [(s, e) for _, s, e in phases],
            "real": phases[1][0],
            "probe_real": [phases[0][0], phases[2][0]],
            "ns": ns,
            "grid_passes": passes[-2:],
        }
        print(
            f"{name}: sent at {rates[name]} req/s, real {phases[1][0]['output_throughput']:.1f} "
            f"tok/s ({time.perf_counter() - t0:.0f} s so far)",
            flush=True,
        )
    for name, row in rows.items():
        score(row, grid, work, name)
    grid.close()
    report(rows, args.drift_limit)
    if args.result_file:
        keep = {
            n: {k: v for k, v in r.items() if k not in ("ns", "grid_passes", "steps")}
            for n, r in rows.items()
        }
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump({"settings": keep, "args": vars(args)}, f, indent=2, default=str)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


def score(row: dict, grid: GridProbe, work: str, name: str) -> None:
    """The three checks of one setting (see the module docstring), into `row`."""
    trace = read_trace(row["log"])
    (p0s, p0e), (ss, se), (p1s, p1e) = row["phases"]
    rep = compare(trace, replay(trace))
    rep.pop("requests")
    row["replay"] = rep
    # the profile of the neighbouring probes: both grid passes, the serving overhead of both
    # probe traces (run on this setting's server), the latency outside the engine they show
    runner = grid.profile(row["grid_passes"])
    probe_steps = [s for a, b in ((p0s, p0e), (p1s, p1e)) for s in in_window(trace, a, b)[0]]
    block_bytes = trace.block_bytes
    terms, _ = fit_serving_rates(runner, logged_steps(probe_steps, block_bytes))
    outside = []
    for (a, b), real in zip(((p0s, p0e), (p1s, p1e)), row["probe_real"], strict=True):
        outside.append(real["mean_ttft_ms"] - engine_ttft_ms(trace, in_window(trace, a, b)[1]))
    profile = {**runner, **terms, "request_latency_s": max(0.0, statistics.mean(outside)) / 1e3}
    path = os.path.join(work, f"profile-{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile, f)
    model = ProfiledCostModel(profile)
    steps, setting_ids = in_window(trace, ss, se)
    by_kind: dict[str, list[float]] = {}
    for st in logged_steps(steps, block_bytes):
        err = abs(model.step_time(st.batch) - st.seconds) / st.seconds
        by_kind.setdefault("all", []).append(err)
        by_kind.setdefault(kind(st), []).append(err)
    row["step_error"] = {
        k: {"steps": len(v), "median": quantile(v, 0.5), "p90": quantile(v, 0.9)}
        for k, v in by_kind.items()
    }
    # the drift between the probes: the grid, and the probe traces' median step time
    before, after = (in_window(trace, p0s, p0e)[0], in_window(trace, p1s, p1e)[0])
    trace_drift = (
        statistics.median(s.seconds for s in after) / statistics.median(s.seconds for s in before)
        - 1.0
    )
    row["drift"] = {"grid": grid_drift(*row["grid_passes"]), "probe_trace": trace_drift}
    row["outside_engine_ms"] = {
        "probes": outside,
        "setting": row["real"]["mean_ttft_ms"] - engine_ttft_ms(trace, setting_ids),
    }
    row["real"]["num_preemptions"] = sum(len(s.preempted) for s in steps)
    ns = row["ns"]
    ns.profile = path
    row["sim"] = run_point(ns, load_samples(ns), row["rate"], include_requests=False)["metrics"]


def report(rows: dict, drift_limit: float) -> None:
    print("\n1. replay: the real scheduler, the logged step times, the same trace")
    print(
        f"{'setting':<10} {'reqs':>5} {'steps':>6} {'TTFT med/p99':>15} {'E2E med/p99':>15} "
        f"{'TPOT med/p99':>15} {'misses':>7} {'preempt r/s':>12} {'outside':>9}  schedule"
    )
    for name, row in rows.items():
        r = row["replay"]
        e = r["relative_error"]

        def pct(k, e=e):
            return f"{100 * e[k]['median']:.2f}/{100 * e[k]['p99']:.2f}%"

        p = r["num_preemptions"]
        d = r["first_divergence"]
        misses = len(r["misses"]["ttft"]) + len(r["misses"]["e2el"])
        print(
            f"{name:<10} {r['num_requests']:5d} {r['num_logged_steps']:6d} {pct('ttft'):>15} "
            f"{pct('e2el'):>15} {pct('tpot'):>15} {misses:7d} "
            f"{p['real']:>5}/{p['simulated']:<6} {row['outside_engine_ms']['setting']:7.1f}ms  "
            f"{'identical' if d is None else 'diverges at step ' + str(d['step'])}"
        )
    print(
        "   outside = the client's mean TTFT less the engine's (HTTP, tokenizing, SSE, "
        "client): not in any step, so not in the replay"
    )
    print(
        f"\n2. step prices: |pred - real| / real of the setting's logged steps, priced by "
        f"the probes on either side; drift > {100 * drift_limit:.0f}% flags the setting"
    )
    print(
        f"{'setting':<10} {'kind':<13} {'steps':>6} {'median':>8} {'p90':>8} {'drift':>14}  verdict"
    )
    for name, row in rows.items():
        dr = row["drift"]
        drift = max(abs(dr["grid"]), abs(dr["probe_trace"]))
        flagged = drift > drift_limit
        a = row["step_error"]["all"]
        ok = a["median"] <= 0.10 and a["p90"] <= 0.25
        verdict = "unmeasurable (drift)" if flagged else ("met" if ok else "MISSED")
        for k, v in sorted(row["step_error"].items(), key=lambda kv: kv[0] != "all"):
            print(
                f"{name:<10} {k:<13} {v['steps']:6d} {100 * v['median']:7.1f}% "
                f"{100 * v['p90']:7.1f}% {100 * dr['grid']:+6.1f}/{100 * dr['probe_trace']:+5.1f}%"
                f"  {verdict if k == 'all' else ''}"
            )
    print("   drift = grid / probe trace, the later probe against the earlier")
    print("\n3. end to end: the real trace against its simulation with the probes' profile")
    print(f"{'setting':<10} {'metric':<10} {'real':>9} {'sim':>9} {'error':>8} {'drift':>7}")
    for name, row in rows.items():
        dr = max(abs(row["drift"]["grid"]), abs(row["drift"]["probe_trace"]))
        for key, label in METRICS:
            real, sim = row["real"][key], row["sim"][key]
            err = (sim - real) / real if real else float("nan")
            print(
                f"{name:<10} {label:<10} {real:9.1f} {sim:9.1f} {100 * err:+7.1f}% {100 * dr:6.1f}%"
            )
        print(
            f"{name:<10} {'preempt':<10} {row['real']['num_preemptions']:>9} "
            f"{row['sim']['num_preemptions']:>9}"
        )


if __name__ == "__main__":
    main()
