"""What only the engine loop can see, counted as it happens: tokens per step, the interval before
each output token, and how requests finished (aborts included, which never reach a front end as
a finished `RequestOutput`).

The engine owns these; `/metrics` reads a snapshot (`EngineStats.snapshot()`), copied after each
step like `LLMEngine.get_metrics()`, so a scrape never touches the engine thread. Plain Python, no
prometheus_client here: the exposition is tessera/engine/metrics.py's job.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tessera.outputs import EmbeddingRequestOutput, RequestOutput

# vLLM's buckets for these series
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                       5.0, 10.0, 30.0)


@dataclass
class HistogramData:
    """Fixed buckets (upper bounds, +Inf implied), per-bucket counts (not cumulative) and sum."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> HistogramData:
        return HistogramData(self.buckets, list(self.counts), self.sum)


@dataclass
class StatsSnapshot:
    """What `/metrics` exposes from the engine besides `get_metrics()`'s flat gauges/counters."""

    # keyed by the series name (without the prefix): iteration_tokens_total, inter_token_latency
    histograms: dict[str, HistogramData] = field(default_factory=dict)
    finished_reasons: dict[str, int] = field(default_factory=dict)  # request_success_total


class EngineStats:
    """Observed by `LLMEngine.step()` and `abort_request()`; O(requests in the step) per step."""

    def __init__(self, kv_transfer: bool = False) -> None:
        self.iteration_tokens = HistogramData(ITERATION_TOKEN_BUCKETS)
        # seconds per KV transfer (disaggregated prefill/decode), when a connector is configured
        self.kv_transfer_time = HistogramData(KV_TRANSFER_BUCKETS) if kv_transfer else None
        # one observation per request per step that gave it a token after its first: the time
        # since its previous token (vLLM's inter-token latency, also its time_per_output_token)
        self.inter_token_latency = HistogramData(ITL_BUCKETS)
        self.finished_reasons: dict[str, int] = {}
        self._last_token_time: dict[str, float] = {}

    def observe_step(self, now: float, num_scheduled_tokens: int,
                     outputs: list[RequestOutput | EmbeddingRequestOutput],
                     token_request_ids: list[str]) -> None:
        """`token_request_ids`: the requests that gained tokens this step."""
        if num_scheduled_tokens:
            self.iteration_tokens.observe(num_scheduled_tokens)
        last = self._last_token_time
        for rid in token_request_ids:
            prev = last.get(rid)
            if prev is not None:
                self.inter_token_latency.observe(max(0.0, now - prev))
            last[rid] = now
        for out in outputs:
            if out.finished:
                last.pop(out.request_id, None)
                self.count_finished(_finish_reason(out))

    def observe_kv_transfers(self, seconds: list[float]) -> None:
        if self.kv_transfer_time is not None:
            for value in seconds:
                self.kv_transfer_time.observe(value)

    def observe_aborted(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._last_token_time.pop(rid, None)
            self.count_finished("abort")

    def count_finished(self, reason: str) -> None:
        self.finished_reasons[reason] = self.finished_reasons.get(reason, 0) + 1

    def snapshot(self) -> StatsSnapshot:
        histograms = {"iteration_tokens_total": self.iteration_tokens.copy(),
                      "inter_token_latency_seconds": self.inter_token_latency.copy()}
        if self.kv_transfer_time is not None:
            histograms["kv_transfer_time_seconds"] = self.kv_transfer_time.copy()
        return StatsSnapshot(histograms=histograms, finished_reasons=dict(self.finished_reasons))


def _finish_reason(out: RequestOutput | EmbeddingRequestOutput) -> str:
    """One reason per request (vLLM counts requests, not sequences): the first sequence's; a
    request rejected at admission counts as `length` (what its outputs would say); an embedding
    stops when its prompt is done."""
    if isinstance(out, EmbeddingRequestOutput):
        return "length" if out.error is not None else "stop"
    for o in out.outputs:
        if o.finish_reason is not None:
            return o.finish_reason
    return "length" if out.error is not None else "abort"
