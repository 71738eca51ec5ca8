"""`tessera bench sweep`: start the server once per setting, bench it at each request rate, stop
it with SIGINT, and plot throughput and p99 latencies against rate (one line per setting).

    tessera bench sweep --dataset sharegpt --num-prompts 100 --request-rates 1 2 4 inf \\
        --server-args "--dtype bfloat16" \\
        --settings "--max-num-batched-tokens 512" " --enable-chunked-prefill" \\
        --result-file sweep.json --plot-file sweep.png

A setting is one string of extra server flags ("" is the plain server). argparse takes a value
that starts with "--" for a flag unless it holds a space, so write a lone flag with a leading
space (" --enable-chunked-prefill") or as `--settings=--enable-chunked-prefill`.
The same samples (same seed) are sent at every point. `--server-cmd` runs any other server (a
template with {python} and {port}); after each point the `*_total` counters of its /metrics
(preemptions, prefix-cache hits...) are stored as differences.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from tessera.bench.config import add_workload_args, config_from_args
from tessera.bench.report import json_rate, save_json
from tessera.bench.serve import _setup_logging, prepare, run_bench

logger = logging.getLogger(__name__)

DEFAULT_SERVER_CMD = "{python} -m tessera.entrypoints.cli serve --port {port}"
PANELS = (("request_throughput", "request throughput (req/s)"),
          ("output_throughput", "output throughput (tok/s)"),
          ("p99_ttft_ms", "p99 TTFT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)"),
          ("p99_itl_ms", "p99 ITL (ms)"), ("p99_e2el_ms", "p99 E2E latency (ms)"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(template: str, port: int, extra: str) -> list[str]:
    argv = [tok.format(python=sys.executable, port=port) for tok in shlex.split(template)]
    return argv + shlex.split(extra)


class ServerProcess:
    """A server subprocess for a `with` block: up and healthy on entry, SIGINT-ed on exit."""

    def __init__(self, argv: list[str], base_url: str, log_path: str, startup_timeout: float,
                 env: dict[str, str] | None = None):
        self.argv, self.base_url, self.log_path, self.env = argv, base_url, log_path, env
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        logger.info("starting %s (log: %s)", shlex.join(self.argv), self.log_path)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before "
                                   f"becoming healthy:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0,
                             trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server was not healthy after {self.startup_timeout:.0f} s:\n"
                           f"{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT (a graceful shutdown), then SIGTERM, then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
                return
            except subprocess.TimeoutExpired:
                logger.warning("server %d ignored %s", self.proc.pid, sig.name)

    def log_tail(self, num_chars: int = 3000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")[-num_chars:]


def scrape_counters(base_url: str) -> dict[str, float]:
    """Every `*_total` counter of /metrics (Prometheus text), summed over labels; {} if none."""
    try:
        response = httpx.get(base_url + "/metrics", timeout=5.0, trust_env=False)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    counters: dict[str, float] = {}
    for line in response.text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0].strip()
        if name.endswith("_total"):
            try:
                counters[name] = counters.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return counters


def sweep(args: argparse.Namespace, samples, tokenizer) -> dict:
    """Every (setting, rate) point; the sweep JSON with one summary per point."""
    points = []
    log_dir = args.result_dir or tempfile.mkdtemp(prefix="tessera-sweep-")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
    for i, setting in enumerate(args.settings):
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        argv = server_argv(args.server_cmd, port, f"{args.server_args} {setting}")
        log_path = os.path.join(log_dir, f"server-{i}.log")
        with ServerProcess(argv, base_url, log_path, args.server_timeout):
            for rate in args.request_rates:
                label = setting.strip() or "default"
                print(f"--- setting {label!r}, request rate {rate}", flush=True)
                cfg = config_from_args(args, base_url=base_url, request_rate=rate)
                before = scrape_counters(base_url)
                result_file = (os.path.join(args.result_dir, f"setting{i}-rate{rate}.json")
                               if args.result_dir else None)
                data = run_bench(cfg, samples, tokenizer, result_file=result_file,
                                 extra_config={"setting": setting, "dataset": args.dataset})
                after = scrape_counters(base_url)
                delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
                points.append({"setting": label, "server_argv": argv,
                               "request_rate": json_rate(rate), "metrics": data["metrics"],
                               "server_counters": delta})
    return {"dataset": args.dataset, "num_prompts": len(samples), "points": points}


def plot_sweep(path: str, data: dict) -> None:
    """A 2x3 figure: throughputs and p99 latencies against request rate, a line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({_rate(p["request_rate"]) for p in data["points"]})
    x_of = {r: i for i, r in enumerate(rates)}  # categorical: "inf" needs a place too
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    settings = list(dict.fromkeys(p["setting"] for p in data["points"]))
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        for setting in settings:
            pts = sorted((_rate(p["request_rate"]), p["metrics"][key])
                         for p in data["points"] if p["setting"] == setting)
            ax.plot([x_of[r] for r, _ in pts], [v for _, v in pts], marker="o", label=setting)
        ax.set_xticks(range(len(rates)), [("inf" if math.isinf(r) else f"{r:g}") for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{data['dataset']}, {data['num_prompts']} prompts per point")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rate(value) -> float:
    return float("inf") if value == "inf" else float(value)


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep")
    g.add_argument("--request-rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, math.inf],
                   help="rates to run at each setting (default: 1 2 4 inf)")
    g.add_argument("--settings", nargs="+", default=[""], metavar="FLAGS",
                   help='server flags per setting, e.g. "" " --enable-chunked-prefill" '
                        '(a lone flag needs a leading space)')
    g.add_argument("--server-args", default="", help="flags given to the server in every setting")
    g.add_argument("--server-cmd", default=DEFAULT_SERVER_CMD,
                   help="server command template with {python} and {port} "
                        "(default: %(default)s)")
    g.add_argument("--server-timeout", type=float, default=900.0,
                   help="seconds to wait for /health (default: %(default)s)")
    add_workload_args(p)
    out = p.add_argument_group("output")
    out.add_argument("--result-file", default="sweep.json", help="default: %(default)s")
    out.add_argument("--plot-file", default="sweep.png", help="default: %(default)s")
    out.add_argument("--result-dir", default=None,
                     help="also keep each point's full result JSON and the server logs here")


def sweep_main(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Entry of `tessera bench sweep`."""
    _setup_logging()
    _, tokenizer, samples = prepare(args, parser)  # validates the flags before starting any server
    data = sweep(args, samples, tokenizer)
    save_json(args.result_file, data)
    plot_sweep(args.plot_file, data)
    print(f"wrote {args.result_file} and {args.plot_file}")
    return 0
