"""Serving benchmarks, measured the way `vllm bench serve` measures.

- `datasets`: the workloads (sharegpt, random, prefix) as `SampleRequest`s
- `client`: arrival times and one timed streaming request
- `report`: metrics, the printed table, the result JSON, the CDF figure
- `serve`: `tessera bench serve` (also `python -m tessera.bench.serve`)
- `sweep`: `tessera bench sweep`, which starts the server per setting and plots against rate

matplotlib and transformers load only when a subcommand runs, so `tessera --help`
stays fast.
"""

from __future__ import annotations

import argparse


def _run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    from tessera.bench.serve import serve_main

    return serve_main(args, parser)


def _run_sweep(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    from tessera.bench.sweep import sweep_main

    return sweep_main(args, parser)


def add_bench_parser(subparsers) -> None:
    """Register `bench` with its sub-subcommands `serve` and `sweep` (each sets `func`)."""
    from tessera.bench.config import add_serve_args
    from tessera.bench.sweep import add_sweep_args

    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server",
                                  description="Serving benchmarks (as `vllm bench serve`).")
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    serve = commands.add_parser(
        "serve", help="load a running completions endpoint and report latencies",
        description="Load any OpenAI-compatible /v1/completions or /v1/chat/completions "
                    "endpoint (ours, llama.cpp, vLLM) and report throughput, TTFT/TPOT/ITL/E2E "
                    "percentiles and goodput.")
    add_serve_args(serve)
    serve.set_defaults(func=_run_serve)
    sweep = commands.add_parser(
        "sweep", help="start the server per setting and bench it at several rates",
        description="Start `tessera serve` once per setting, bench it at each request rate, "
                    "and plot throughput and p99 latencies against rate.")
    add_sweep_args(sweep)
    sweep.set_defaults(func=_run_sweep)
