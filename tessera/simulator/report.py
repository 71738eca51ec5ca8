"""From a simulation to what `tessera bench serve` reports: the same `RequestResult`s, metrics,
table and result JSON (tessera/bench/report.py), plus the simulator's own timeline figure (queue
lengths, KV usage and batch size over virtual time).

A request's times are measured as the bench client measures them, from its send: TTFT to the step
that produced its first token, ITL between later tokens (one per step, as the server streams them),
E2E to its last token.
"""

from __future__ import annotations

import numpy as np

from tessera.bench.report import RequestResult, compute_metrics, result_json
from tessera.simulator.simulator import SimOutcome, Timeline


def request_results(outcome: SimOutcome) -> list[RequestResult]:
    results = []
    for rec in outcome.records:
        times = rec.token_times
        if rec.error is not None or rec.finished is None:
            results.append(RequestResult(prompt_len=rec.prompt_len,
                                         error=rec.error or "did not finish"))
            continue
        if not times:  # finished without a token (cannot happen with ignore_eos, kept honest)
            results.append(
                RequestResult(
                    success=True,
                    prompt_len=rec.prompt_len,
                    ttft=rec.finished - rec.sent,
                    e2el=rec.finished - rec.sent,
                )
            )
            continue
        itl = np.diff(np.asarray(times)).tolist() if len(times) > 1 else []
        results.append(RequestResult(success=True, prompt_len=rec.prompt_len,
                                     output_tokens=len(times), ttft=times[0] - rec.sent,
                                     itl=itl, e2el=times[-1] - rec.sent))
    return results


def simulation_json(outcome: SimOutcome, config: dict, slos: dict[str, float] | None = None,
                    include_requests: bool = True) -> dict:
    """bench serve's result JSON (config, metrics, requests) with the simulator's counters in
    `metrics` and the timeline alongside."""
    results = request_results(outcome)
    metrics = compute_metrics(results, outcome.duration_s, slos)
    metrics.update(outcome.counters)
    metrics["num_steps"] = outcome.num_steps
    metrics["engine_clock"] = engine_means(outcome, config.get("request_latency_s") or 0.0)
    metrics["wall_time_s"] = outcome.wall_time_s
    metrics["simulated_requests_per_wall_s"] = len(results) / max(outcome.wall_time_s, 1e-9)
    data = result_json(metrics, results if include_requests else [], config)
    if not include_requests:
        data.pop("requests")
    tl = outcome.timeline
    data["timeline"] = {name: getattr(tl, name) for name in Timeline.__dataclass_fields__}
    return data


def engine_means(outcome: SimOutcome, latency_s: float) -> dict[str, float]:
    """The means the server's own histograms report (engine clock, from the engine's arrival,
    `latency_s` after the send): TTFT, queue time (to first scheduled) and prefill time (first
    scheduled to first token), in ms; to set beside serving.server_means."""
    ttft, queue, prefill = [], [], []
    for rec in outcome.records:
        if rec.error is not None or not rec.token_times or rec.first_scheduled is None:
            continue
        arrival = rec.sent + latency_s
        ttft.append(rec.token_times[0] - arrival)
        queue.append(rec.first_scheduled - arrival)
        prefill.append(rec.token_times[0] - rec.first_scheduled)
    if not ttft:
        return {}
    return {
        "mean_ttft_ms": 1e3 * float(np.mean(ttft)),
        "mean_queue_ms": 1e3 * float(np.mean(queue)),
        "mean_prefill_ms": 1e3 * float(np.mean(prefill)),
    }


def plot_timeline(path: str, timeline: dict, title: str = "") -> None:
    """Three panels over virtual time: queue lengths, KV cache usage, batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.asarray(timeline["time"])
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for name, label in (("num_waiting", "waiting"), ("num_running", "running"),
                        ("num_swapped", "swapped")):
        axes[0].plot(t, timeline[name], label=label, linewidth=1)
    axes[0].set_ylabel("requests")
    axes[0].legend(loc="upper right")
    axes[0].set_title("queue lengths")
    axes[1].plot(t, 100.0 * np.asarray(timeline["kv_usage"]), color="tab:red", linewidth=1)
    axes[1].set_ylabel("%")
    axes[1].set_ylim(0, 102)
    axes[1].set_title("KV cache usage (device blocks)")
    axes[2].plot(t, timeline["batch_seqs"], label="sequences", linewidth=1)
    ax2 = axes[2].twinx()
    ax2.plot(t, timeline["batch_tokens"], color="tab:green", alpha=0.5, linewidth=0.8,
             label="tokens")
    axes[2].set_ylabel("sequences per step")
    ax2.set_ylabel("tokens per step", color="tab:green")
    axes[2].set_title("batch size")
    axes[2].set_xlabel("virtual time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def request_results_from_json(data: dict) -> list[RequestResult]:
    """The `RequestResult`s of a result JSON's per-request records (as bench serve plots them)."""
    return [RequestResult(**{k: v for k, v in r.items() if k != "tpot"}) for r in data["requests"]]
