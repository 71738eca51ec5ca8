"""From per-request timings to the figures `vllm bench serve` reports, and their outputs: the
printed table, the JSON result and a figure of latency CDFs.

Definitions (as vLLM's): TTFT is send to first text chunk; ITL the gaps between later chunks;
TPOT is (E2E - TTFT) / (output_tokens - 1) per request (requests of one token have none); E2E is
send to last chunk. Throughputs divide totals over the successful requests by the wall-clock
duration of the whole run. Goodput counts the successful requests that meet every given SLO.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
LATENCY_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request measured; times in seconds from its own send."""

    success: bool = False
    prompt_len: int = 0  # the server's usage.prompt_tokens when given, else the dataset's count
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        key, sep, value = spec.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {GOODPUT_KEYS}, got {spec!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of ms") from None
        if slos[key] < 0:
            raise ValueError(f"--goodput {spec!r}: the SLO must be >= 0 ms")
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """A successful request within every SLO (ms); a request without a TPOT passes that one."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    return all(values[key] * 1000.0 <= slo for key, slo in slos.items())


def _stats(values_s: list[float]) -> dict[str, float]:
    """mean, median, std and percentiles, in ms (zeros for an empty list, as vLLM prints)."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    out.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Per-latency lists in seconds over successful requests (ITL: every gap of every request)."""
    ok = [r for r in results if r.success]
    return {"ttft": [r.ttft for r in ok],
            "tpot": [r.tpot for r in ok if r.tpot is not None],
            "itl": [gap for r in ok for gap in r.itl],
            "e2el": [r.e2el for r in ok]}


def compute_metrics(results: list[RequestResult], duration_s: float,
                    slos: dict[str, float] | None = None) -> dict:
    """The summary of a run: counts, throughputs, goodput and latency statistics (ms)."""
    assert duration_s > 0, "duration must be positive"
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    metrics: dict = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "request_goodput": None,
    }
    if slos:
        metrics["request_goodput"] = sum(meets_slos(r, slos) for r in ok) / duration_s
        metrics["goodput_slos_ms"] = dict(slos)
    for name, values in latency_samples(results).items():
        for stat, value in _stats(values).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


def format_table(metrics: dict) -> str:
    """The result block, laid out like vLLM's so the two read side by side."""
    rows = [("Successful requests:", metrics["completed"]),
            ("Failed requests:", metrics["failed"]),
            ("Benchmark duration (s):", f"{metrics['duration_s']:.2f}"),
            ("Total input tokens:", metrics["total_input_tokens"]),
            ("Total generated tokens:", metrics["total_output_tokens"]),
            ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}")]
    if metrics.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", f"{metrics['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
             ("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    for name in LATENCIES:
        lines.append("{s:{c}^50}".format(s=LATENCY_NAMES[name], c="-"))
        label = name.upper()
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES if p != 50)):
            title = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            lines.append(f"{f'{title} {label} (ms):':<40}{metrics[f'{stat}_{name}_ms']:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def result_json(metrics: dict, results: list[RequestResult], config: dict) -> dict:
    """Everything a later plot or comparison needs: config, summary and per-request records."""
    requests = []
    for r in results:
        record = asdict(r)
        record["tpot"] = r.tpot
        requests.append(record)
    return {"config": config, "metrics": metrics, "requests": requests}


def save_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, allow_nan=False, default=_jsonable)
        f.write("\n")


def _jsonable(value):
    raise TypeError(f"not JSON-serializable: {value!r}")


def json_rate(rate: float) -> float | str:
    """JSON has no infinity: an infinite request rate is written as "inf"."""
    return "inf" if math.isinf(rate) else rate


def plot_cdfs(path: str, results: list[RequestResult], title: str = "") -> None:
    """One panel per latency (TTFT, TPOT, ITL, E2E): the empirical CDF in ms, p50/p99 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = latency_samples(results)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, LATENCIES, strict=True):
        ms = np.sort(np.asarray(samples[name], dtype=np.float64) * 1000.0)
        if ms.size:
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
            for p, style in ((50, ":"), (99, "--")):
                ax.axvline(np.percentile(ms, p), color="gray", linestyle=style, label=f"p{p}")
            ax.legend(loc="lower right")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(LATENCY_NAMES[name])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
