"""The serving overhead a profile of the runner alone does not see, measured and fitted from short
runs of the real server (`tessera simulate calibrate --serving-requests N`).

Behind `tessera serve` a request also costs time outside the runner, of two kinds:

- **latency outside the engine** (`request_latency_s`): the HTTP request is parsed, its prompt
  tokenized and handed to the engine thread, and each output crosses back to the event loop,
  is written as an SSE chunk and parsed by the client. The server's own histograms time a
  request from the engine's arrival to its first token (engine clock); bench serve times it
  from the client's send. The difference of the two mean TTFTs is measured, not fitted: it is
  what the client waits that no engine step explains. The simulator hands each request to the
  scheduler that long after its send.
- **time each step spends around the runner** on these 2 cores: the engine thread processes
  the outputs (detokenizing, stop strings) and hands them to the event loop, which encodes an SSE
  chunk per token while the runner of the next step competes with it, and the bench client on
  the same machine parses them. Three non-negative rates model it: seconds per step
  (`serving_s_per_step`), per scheduled sequence (`serving_s_per_seq`) and per prefill token
  (`serving_s_per_prefill_token`). They are fitted to the real server's own steps: the
  calibration runs it with the engine's step log on (`--step-log`,
  tessera/engine/step_log.py), prices each logged step with the runner-only profile, and fits
  the rates to the difference from the real step interval (start to next start), by
  non-negative least squares on the absolute error (seconds). Why not on relative error, as
  the runner's grid (fit.py): latencies are sums of step times, and a log holds ten or more
  decode steps for every step with a prefill. Weighted per step, the decode steps set the rates
  and the long steps, where most of the time goes, came out short (mixed steps 1440 ms
  modelled against 1568 real on one log here; 1572 fitted in seconds, decode steps 134 against
  135 either way).

Why steps and not the end metrics: an earlier version bisected two rates until the simulated
mean TPOT and TTFT of the calibration trace equalled the measured ones. Any error of the trace's
means landed in the rates, and the per-prefill-token rate came out 0.2-0.27 ms in two of three
calibrations, where the logged prefill steps showed none: every simulated TTFT was 11-30% high
(docs/simulator.md). Fitted to steps, TTFT and TPOT are predictions; the
calibration trace's means are reported beside the simulated ones as a check.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import sys
import tempfile

from tessera.config import EngineArgs
from tessera.simulator.cost_model import SERVING_FEATURES
from tessera.simulator.step_fit import fit_serving_rates, read_step_log

logger = logging.getLogger(__name__)

# the calibration trace: not one of the fidelity benchmark's traces; at about half of this
# machine's capacity, where a server usually runs (at rate inf the fit also absorbed the grid's
# error on 2048-token prefill steps and came out 2-3x too high for a loaded-but-stable server)
TRACE = {"dataset": "random", "random_input_len": 192, "random_output_len": 48,
         "random_range_ratio": 0.5, "num_prompts": 48}
TRACE_RATE = 3.2  # 0.8 while the server ran its steps off the loading thread, 2.3x slower


def engine_flags(args: EngineArgs, skip: tuple[str, ...] = ()) -> list[str]:
    """The command-line flags that give `args` (every field that is not the default)."""
    from tessera.config import flag_name

    default = EngineArgs()
    argv: list[str] = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if f.name in skip or value == getattr(default, f.name):
            continue
        if isinstance(value, bool):
            argv.append(flag_name(f.name) if value else f"--no-{f.name.replace('_', '-')}")
        else:
            argv += [flag_name(f.name), str(value)]
    return argv


def real_server_metrics(flags: list[str], samples, rate: float, seed: int,
                        log_dir: str | None = None, label: str = "server",
                        step_log: str | None = None) -> dict:
    """Start `tessera serve` on 127.0.0.1 with `flags`, send `samples` with bench serve
    (ignore_eos: the dataset's output lengths), stop it; bench serve's metrics, with the
    server's preemption count (from /metrics) as `num_preemptions` and the means of its
    engine-clock request histograms as `server` (`server_means`). With `step_log`, the server
    writes its engine step log there (tessera/engine/step_log.py)."""
    from tessera.bench.config import BenchConfig
    from tessera.bench.serve import load_bench_tokenizer, run_bench
    from tessera.bench.sweep import ServerProcess, free_port, scrape_counters

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tessera.entrypoints.cli", "serve", "--port", str(port), *flags]
    if step_log is not None:
        argv += ["--step-log", step_log]
    log_dir = log_dir or tempfile.mkdtemp(prefix="tessera-serving-")
    with ServerProcess(argv, base_url, os.path.join(log_dir, f"{label}.log"), 600.0):
        cfg = BenchConfig(base_url=base_url, request_rate=rate, seed=seed, ignore_eos=True,
                          disable_tqdm=True)
        metrics = run_bench(cfg, samples, load_bench_tokenizer(None), quiet=True)["metrics"]
        metrics["num_preemptions"] = scrape_counters(base_url).get("tessera:num_preemptions_total")
        metrics["server"] = server_means(base_url)
        return metrics


# the server's per-request histograms (engine clock, tessera/engine/metrics.py) whose means
# `server_means` reports, by the key it reports them under
SERVER_HISTOGRAMS = {
    "mean_ttft_ms": "tessera:time_to_first_token_seconds",
    "mean_queue_ms": "tessera:request_queue_time_seconds",
    "mean_prefill_ms": "tessera:request_prefill_time_seconds",
    "mean_tpot_ms": "tessera:request_time_per_output_token_seconds",
    "mean_e2el_ms": "tessera:e2e_request_latency_seconds",
}


def parse_histogram_means(text: str) -> dict[str, float]:
    """Means (ms) of `SERVER_HISTOGRAMS` from Prometheus text: `_sum` / `_count`, summed over
    labels; a histogram with no observation is left out."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0].strip()
        for suffix, into in (("_sum", sums), ("_count", counts)):
            if name.endswith(suffix):
                base = name.removesuffix(suffix)
                into[base] = into.get(base, 0.0) + float(value)
    return {key: 1e3 * sums[h] / counts[h] for key, h in SERVER_HISTOGRAMS.items()
            if counts.get(h) and h in sums}


def server_means(base_url: str) -> dict[str, float]:
    import httpx

    response = httpx.get(base_url + "/metrics", timeout=5.0, trust_env=False)
    response.raise_for_status()
    return parse_histogram_means(response.text)


def median_run(runs: list[dict]) -> dict:
    """One run's figures from several runs of `real_server_metrics`: the median of every number
    (and of the server's histogram means), failures summed. Why: on shared cores the same trace
    and flags vary by 5-25% from one run to the next; the median of a few is what a model of
    the machine can be held to."""
    out: dict = {}
    for key, value in runs[0].items():
        if key == "server":
            keys = set.intersection(*(set(r.get("server", {})) for r in runs))
            out[key] = {k: statistics.median(r["server"][k] for r in runs) for k in keys}
        elif key == "failed":
            out[key] = sum(r[key] for r in runs)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
            out[key] = statistics.median(values) if len(values) == len(runs) else None
        else:
            out[key] = value
    return out


def request_latency(real: dict) -> float:
    """Seconds a request waits outside the engine: the client's mean TTFT less the server's."""
    server = real.get("server", {})
    if "mean_ttft_ms" not in server:
        raise ValueError("the server reported no time_to_first_token histogram")
    return max(0.0, (real["mean_ttft_ms"] - server["mean_ttft_ms"]) / 1e3)


class ServingRuns:
    """Runs of the real server on the calibration trace, each with its engine step log, then the
    fit of the latency outside the engine (the median run) and the serving rates (every logged
    step of every run): the module docstring says which and why. `calibrate` makes one run
    after each pass over its grid."""

    def __init__(self, args: EngineArgs, num_requests: int, rate: float | None = None) -> None:
        from tessera.bench import datasets
        from tessera.bench.serve import load_bench_tokenizer

        self.args, self.real_runs, self.step_logs = args, [], []
        self.rate = TRACE_RATE if rate is None else rate
        self.log_dir = tempfile.mkdtemp(prefix="tessera-calibration-")
        t = TRACE
        self.samples = datasets.sample_random(load_bench_tokenizer(None), num_requests,
                                              t["random_input_len"], t["random_output_len"],
                                              t["random_range_ratio"], seed=args.seed)

    def run(self) -> None:
        label = f"calibration-server-{len(self.real_runs)}"
        step_log = os.path.join(self.log_dir, f"{label}.steps.jsonl")
        self.real_runs.append(real_server_metrics(
            engine_flags(self.args), self.samples, self.rate, self.args.seed,
            log_dir=self.log_dir, label=label, step_log=step_log))
        self.step_logs.append(step_log)

    def fit(self, profile: dict) -> dict:
        return fit_serving(self.args, profile, self.samples, self.rate, self.real_runs,
                           self.step_logs)


def runner_only(profile: dict) -> dict:
    """The profile less its serving overhead: the runner-only prices `fit_serving` fits the
    overhead against (a profile that already holds rates would count them twice)."""
    drop = {"request_latency_s", "serving_fit", *(name for name, _ in SERVING_FEATURES)}
    return {k: v for k, v in profile.items() if k not in drop}


def fit_serving(args: EngineArgs, profile: dict, samples, rate: float, real_runs: list[dict],
                step_logs: list[str]) -> dict:
    """The latency outside the engine (from the median of the real runs of the calibration
    trace `samples` sent at `rate`) and the serving rates (from their step logs), with the check
    that the simulation of the trace gives back its measured means."""
    from tessera.config import GiB
    from tessera.simulator.cost_model import ProfiledCostModel
    from tessera.simulator.report import request_results
    from tessera.simulator.simulator import Simulator
    from tessera.simulator.workload import probe_request, sim_requests

    real = median_run(real_runs)
    latency = statistics.median(request_latency(r) for r in real_runs)
    config = args.create_engine_config(profile["max_position_embeddings"], profile["dtype"])
    block_bytes = ProfiledCostModel(profile).geometry.block_bytes(config.cache.block_size)
    steps = [step for path in step_logs for step in read_step_log(path, block_bytes)]
    terms, by_kind = fit_serving_rates(profile, steps)

    def simulate_means(candidate: dict) -> tuple[float, float]:
        """(mean TPOT, mean TTFT) in seconds, as bench serve computes them."""
        num_gpu = (config.cache.num_gpu_blocks_override
                   or int(config.cache.kv_cache_space * GiB) // block_bytes)
        sim = Simulator(config, ProfiledCostModel(candidate), num_gpu,
                        int(config.cache.swap_space * GiB) // block_bytes)
        requests = sim_requests(samples, rate, 1.0, args.seed)
        outcome = sim.run(requests, record_timeline=False, probe=probe_request(requests))
        results = [r for r in request_results(outcome) if r.success]
        tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
        return (sum(tpots) / len(tpots), sum(r.ttft for r in results) / len(results))

    runner_only = simulate_means(profile)
    fitted = simulate_means({**profile, "request_latency_s": latency, **terms})
    logger.info("serving overhead from %d logged steps: %.0f ms latency outside the engine, "
                "%.2f ms per step, %.3f ms per sequence, %.4f ms per prefill token (real mean "
                "TPOT %.1f ms, TTFT %.0f ms; simulated %.1f / %.0f; runner-only %.1f / %.0f)",
                len(steps), latency * 1e3, terms["serving_s_per_step"] * 1e3,
                terms["serving_s_per_seq"] * 1e3, terms["serving_s_per_prefill_token"] * 1e3,
                real["mean_tpot_ms"], real["mean_ttft_ms"], fitted[0] * 1e3, fitted[1] * 1e3,
                runner_only[0] * 1e3, runner_only[1] * 1e3)
    keys = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_e2el_ms",
            "output_throughput")
    return {"request_latency_s": latency, **terms,
            "serving_fit": {"trace": {**TRACE, "num_prompts": len(samples)},
                            "request_rate": rate, "runs": len(real_runs),
                            "logged_steps": len(steps), "steps_by_kind": by_kind,
                            "step_logs": list(step_logs),
                            "real": {k: real[k] for k in keys}, "server": real["server"],
                            "simulated_mean_tpot_ttft_s": list(fitted),
                            "runner_only_mean_tpot_ttft_s": list(runner_only)}}
