"""Prometheus exposition of the engine's counters and the per-request latency histograms.

The engine keeps its own counters (`LLMEngine.get_metrics()`: a flat `{name: value}` dict); this
module only re-publishes the latest snapshot of them, so a scrape never touches the engine. Names
ending in `_total` are exposed as counters, the rest as gauges, each under exactly its key
(`tessera:num_requests_running`). The three histograms are filled from the engine-clock timestamps
of each finished `RequestOutput`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessera.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5)

_HELP = {
    "tessera:num_requests_running": "Requests with sequences running on the device.",
    "tessera:num_requests_waiting": "Requests waiting to be scheduled.",
    "tessera:num_requests_swapped": "Requests whose KV cache is swapped out to CPU.",
    "tessera:kv_cache_usage_perc": "Fraction of device KV cache blocks in use (0 to 1).",
    "tessera:cpu_cache_usage_perc": "Fraction of CPU swap blocks in use (0 to 1).",
    "tessera:num_preemptions_total": "Preemptions since start.",
    "tessera:prompt_tokens_total": "Prompt tokens prefilled since start.",
    "tessera:generation_tokens_total": "Tokens generated since start.",
    "tessera:prefix_cache_hits_total": "Prompt tokens served from the prefix cache.",
    "tessera:prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
    "tessera:spec_decode_num_drafts_total": "Requests that verified draft tokens, summed over steps.",
    "tessera:spec_decode_num_draft_tokens_total": "Draft tokens verified.",
    "tessera:spec_decode_num_accepted_tokens_total": "Draft tokens accepted.",
    "tessera:spec_decode_num_accepted_tokens_per_pos_total": "Draft tokens accepted, by position.",
}


class _EngineCollector(Collector):
    """Yields the engine's latest metric snapshot on each scrape."""

    def __init__(self, snapshot: Callable[[], dict[str, float]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        # `name{label="v"}` keys are samples of one labelled family `name`
        families: dict[str, list[tuple[dict[str, str], float]]] = {}
        for key, value in self._snapshot().items():
            name, labels = _parse_key(key)
            families.setdefault(name, []).append((labels, value))
        for name in sorted(families):
            doc = _HELP.get(name, name)
            samples = families[name]
            label_names = sorted(samples[0][0])
            family: CounterMetricFamily | GaugeMetricFamily
            if name.endswith("_total"):
                # the family drops the suffix; the exposed sample is `name` itself
                family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=label_names)
            else:
                family = GaugeMetricFamily(name, doc, labels=label_names)
            for labels, value in samples:
                family.add_metric([labels[k] for k in label_names], value)
            yield family


def _parse_key(key: str) -> tuple[str, dict[str, str]]:
    """'a_total{position="0"}' -> ('a_total', {'position': '0'}); 'b' -> ('b', {})."""
    if not key.endswith("}") or "{" not in key:
        return key, {}
    name, _, rest = key.partition("{")
    labels = {}
    for part in rest[:-1].split(","):
        k, _, v = part.partition("=")
        labels[k.strip()] = v.strip().strip('"')
    return name, labels


class ServerMetrics:
    """One registry per server: engine gauges/counters plus the latency histograms."""

    def __init__(self, snapshot: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot))
        self.ttft = Histogram(
            "tessera:time_to_first_token_seconds", "Time from arrival to the first output token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            "tessera:time_per_output_token_seconds",
            "Mean time between output tokens of a request, after the first.",
            buckets=_TPOT_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "tessera:e2e_request_latency_seconds", "Time from arrival to the last output token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )

    def observe_finished(self, output: RequestOutput) -> None:
        """Record the latencies of a request that just finished (not of aborted ones)."""
        m = output.metrics
        if output.error is not None or m.first_token_time is None:
            return
        self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        end = m.finished_time or m.last_token_time
        if end is None:
            return
        self.e2e.observe(max(0.0, end - m.arrival_time))
        num_tokens = max((len(o.token_ids) for o in output.outputs), default=0)
        if num_tokens > 1:
            last = m.last_token_time or end
            self.tpot.observe(max(0.0, last - m.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
