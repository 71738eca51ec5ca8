"""The serving overhead a profile of the runner alone does not see, fitted from one short run of
the real server (`tessera simulate calibrate --serving-requests N`).

Behind `tessera serve` each generated token also costs CPU outside the runner: the output
processor detokenizes it, the server encodes and writes one SSE chunk, and the `bench serve`
client (on the same machine here) reads and parses it. On 2 cores that work competes with the
runner's two threads; measured in the first fidelity run, the client alone took ~0.8 of a core,
and the real server ran at 0.65-0.8x of the runner-only prediction. The profile models it as
one more non-negative rate, seconds per sequence per step (`serving_s_per_seq`: a token is
streamed per running sequence per step), fitted by bisection so the simulated mean E2E latency
of the calibration trace equals the measured one (mean E2E, not duration: below saturation the
duration is set by the arrivals). One number fitted on one trace (random prompts, default
flags); the fidelity benchmark then checks it on other traces and flags.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

from tessera.config import EngineArgs

# the calibration trace: not one of the fidelity benchmark's traces; at about 70% of this
# machine's capacity, where a server usually runs (at rate inf the fit also absorbed the grid's
# error on 2048-token prefill steps and came out 2-3x too high for a loaded-but-stable server)
TRACE = {"dataset": "random", "random_input_len": 192, "random_output_len": 48,
         "random_range_ratio": 0.5, "num_prompts": 48}
TRACE_RATE = 0.8


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
                        log_dir: str | None = None, label: str = "server") -> dict:
    """Start `tessera serve` on 127.0.0.1 with `flags`, send `samples` with bench serve
    (ignore_eos: the dataset's output lengths), stop it; bench serve's metrics, with the
    server's preemption count (from /metrics) as `num_preemptions`."""
    from tessera.bench.config import BenchConfig
    from tessera.bench.serve import load_bench_tokenizer, run_bench
    from tessera.bench.sweep import ServerProcess, free_port, scrape_counters

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tessera.entrypoints.cli", "serve", "--port", str(port), *flags]
    log_dir = log_dir or tempfile.mkdtemp(prefix="tessera-serving-")
    with ServerProcess(argv, base_url, os.path.join(log_dir, f"{label}.log"), 600.0):
        cfg = BenchConfig(base_url=base_url, request_rate=rate, seed=seed, ignore_eos=True,
                          disable_tqdm=True)
        metrics = run_bench(cfg, samples, load_bench_tokenizer(None), quiet=True)["metrics"]
        metrics["num_preemptions"] = scrape_counters(base_url).get("tessera:num_preemptions_total")
        return metrics


def fit_serving_overhead(profile: dict, simulate_duration, real_duration: float,
                         hi: float = 0.05, iters: int = 30) -> float:
    """The `serving_s_per_seq` >= 0 at which `simulate_duration(profile)` (any simulated time
    that grows with it: the mean E2E latency) equals the measured one (bisection). 0 if the
    runner alone is already as slow as the server."""
    def duration(s: float) -> float:
        return simulate_duration({**profile, "serving_s_per_seq": s})

    if duration(0.0) >= real_duration:
        return 0.0
    lo = 0.0
    while duration(hi) < real_duration:
        hi *= 2
    for _ in range(iters):
        mid = (lo + hi) / 2
        if duration(mid) < real_duration:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
