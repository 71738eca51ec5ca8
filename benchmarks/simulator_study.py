"""The study of docs/simulator.md: Llama-3-8B on one H100-SXM (roofline cost model, bf16),
ShareGPT, simulated with the real scheduler.

    .venv/bin/python benchmarks/simulator_study.py [--num-prompts 2000]

A. p99 TPOT and p99 ITL against request rate, chunked prefill off (budget 2048) and on with
   budgets 512 and 2048;
B. swap against recompute with a small KV cache (--kv-cache-space 1.5 GiB: 12,288 tokens).

Writes docs/results/simulator_study.json and docs/simulator_study.png. Each point is one
`tessera simulate` run (tessera/simulator/cli.py run_point) on the same samples and arrivals.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import time

from tessera.entrypoints.cli import build_parser
from tessera.simulator.cli import load_samples, run_point, setting_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ("--cost-model roofline --hardware H100-SXM --model-config Llama-3-8B --dtype bfloat16 "
        "--kv-cache-space 40 --dataset sharegpt --quiet")
RATES_A = [8, 16, 24, 32, 40, 48]
SETTINGS_A = {"chunked prefill off (budget 2048)": "",
              "chunked, budget 512": "--enable-chunked-prefill --max-num-batched-tokens 512",
              "chunked, budget 2048": "--enable-chunked-prefill --max-num-batched-tokens 2048"}
RATES_B = [4, 8, 12, 16, 24]
SETTINGS_B = {"swap": "--kv-cache-space 1.5 --swap-space 16 --preemption-mode swap",
              "recompute": "--kv-cache-space 1.5 --preemption-mode recompute",
              "no pressure (40 GiB)": ""}
KEYS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
        "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "num_preemptions",
        "wall_time_s")


def sweep(base, samples, settings: dict[str, str], rates: list[float]) -> list[dict]:
    points = []
    for label, flags in settings.items():
        args = setting_args(base, flags)
        for rate in rates:
            m = run_point(args, samples, rate, include_requests=False)["metrics"]
            points.append({"setting": label, "request_rate": rate,
                           **{k: m[k] for k in KEYS}})
            print(f"{label:<36} rate {rate:>4}: {m['request_throughput']:6.2f} req/s, p99 TPOT "
                  f"{m['p99_tpot_ms']:7.1f} ms, p99 ITL {m['p99_itl_ms']:7.1f} ms, preemptions "
                  f"{m['num_preemptions']:5d} ({m['wall_time_s']:.1f} s)", flush=True)
    return points


def plot(path: str, a: list[dict], b: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [(axes[0, 0], a, "p99_tpot_ms", "A: p99 TPOT (ms)"),
              (axes[0, 1], a, "p99_itl_ms", "A: p99 ITL (ms)"),
              (axes[0, 2], a, "request_throughput", "A: throughput (req/s)"),
              (axes[1, 0], b, "p99_tpot_ms", "B: p99 TPOT (ms), small KV cache"),
              (axes[1, 1], b, "output_throughput", "B: output throughput (tok/s)"),
              (axes[1, 2], b, "num_preemptions", "B: preemptions")]
    for ax, points, key, name in panels:
        for label in dict.fromkeys(p["setting"] for p in points):
            pts = [(p["request_rate"], p[key]) for p in points if p["setting"] == label]
            ax.plot([r for r, _ in pts], [v for _, v in pts], marker="o", label=label)
        ax.set_title(name)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    axes[1, 0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--result-file", default=os.path.join(REPO, "docs", "results",
                                                              "simulator_study.json"))
    parser.add_argument("--plot-file", default=os.path.join(REPO, "docs", "simulator_study.png"))
    args = parser.parse_args()
    base = build_parser().parse_args(["simulate", *shlex.split(BASE),
                                      "--num-prompts", str(args.num_prompts)])
    t0 = time.perf_counter()
    samples = load_samples(base)
    print(f"{len(samples)} ShareGPT samples in {time.perf_counter() - t0:.1f} s", flush=True)
    a = sweep(base, samples, SETTINGS_A, RATES_A)
    b = sweep(base, samples, SETTINGS_B, RATES_B)
    data = {"command": BASE, "num_prompts": len(samples), "A_chunked_prefill": a,
            "B_preemption": b}
    with open(args.result_file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=lambda v: None if math.isnan(v) else v)
    plot(args.plot_file, a, b, f"Llama-3-8B on one H100-SXM (roofline), ShareGPT, "
                               f"{len(samples)} requests per point")
    print(f"wrote {args.result_file} and {args.plot_file} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
