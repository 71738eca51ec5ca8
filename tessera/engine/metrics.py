"""Prometheus exposition of the engine's counters and the per-request latency histograms.

The engine keeps its own counters (`LLMEngine.get_metrics()`: a flat `{name: value}` dict); this
module only re-publishes the latest snapshot of them, so a scrape never touches the engine. Names
ending in `_total` are exposed as counters, the rest as gauges, each under exactly its key
(`tessera:num_requests_running`). The per-request histograms are filled from the engine-clock
timestamps of each finished `RequestOutput`; the per-step ones (tokens per step, the interval
before each output token) and `request_success_total{finished_reason}` come from the engine's
`StatsSnapshot` (tessera/engine/stats.py). Every engine series carries `model_name` (the served
model name), as vLLM's do; process metrics (`process_*`, `python_info`) come from
prometheus_client's own collectors. Why `tessera:` and not `vllm:`: docs/metrics.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tessera.engine.stats import HistogramData, StatsSnapshot
from tessera.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)
_REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
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
    "tessera:spec_decode_num_drafts_total": "Requests that verified draft tokens, summed over "
    "steps.",
    "tessera:spec_decode_num_draft_tokens_total": "Draft tokens verified.",
    "tessera:spec_decode_num_accepted_tokens_total": "Draft tokens accepted.",
    "tessera:spec_decode_num_accepted_tokens_per_pos_total": "Draft tokens accepted, by position.",
    "tessera:prompt_tokens_cached_total": "Prompt tokens whose KV came from the prefix cache.",
    "tessera:kv_transfer_requests_total": "Requests whose KV blocks this engine sent to (producer) "
    "or received from (consumer) a peer.",
    "tessera:kv_transfer_bytes_total": "KV cache bytes sent or received.",
    "tessera:kv_transfer_failures_total":
        "KV transfers that failed: pulls that failed or timed out (the request then prefills "
        "locally), and held blocks no peer pulled in time.",
    "tessera:lora_requests_info":
        "LoRA adapters of the running and the waiting requests (labels; the value is the time "
        "of the last update), and --max-loras.",
    "tessera:num_requests_waiting_for_remote_kvs":
        "Requests holding blocks while their KV arrives from a prefill engine.",
}
_STEP_HISTOGRAMS = {
    # name in the snapshot -> exposed names (one observation set, vLLM's two names for it)
    "iteration_tokens_total": (
        ("tessera:iteration_tokens_total", "Tokens scheduled per engine step."),),
    "inter_token_latency_seconds": (
        ("tessera:inter_token_latency_seconds", "Time between consecutive output tokens."),
        ("tessera:time_per_output_token_seconds",
         "Time between consecutive output tokens (observed per token, as vLLM does)."),
    ),
    "kv_transfer_time_seconds": (
        ("tessera:kv_transfer_time_seconds",
         "Time per KV transfer: a pull from request to landed data (consumer), or reading the "
         "blocks out for a peer (producer)."),),
}


class _EngineCollector(Collector):
    """Yields the engine's latest metric snapshots on each scrape."""

    def __init__(self, snapshot: Callable[[], dict[str, float]], model_name: str,
                 stats: Callable[[], StatsSnapshot] | None) -> None:
        self._snapshot = snapshot
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        label = [self._model_name]
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
                family = CounterMetricFamily(name.removesuffix("_total"), doc,
                                             labels=["model_name", *label_names])
            else:
                family = GaugeMetricFamily(name, doc, labels=["model_name", *label_names])
            for labels, value in samples:
                family.add_metric([*label, *(labels[k] for k in label_names)], value)
            yield family
        if self._stats is None:
            return
        stats = self._stats()
        success = CounterMetricFamily("tessera:request_success", "Finished requests, by reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, count in sorted(stats.finished_reasons.items()):
            success.add_metric([self._model_name, reason], count)
        yield success
        for key, exposed in _STEP_HISTOGRAMS.items():
            data = stats.histograms.get(key)
            if data is None:
                continue
            for name, doc in exposed:
                yield _histogram_family(name, doc, data, label)


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _parse_key(key: str) -> tuple[str, dict[str, str]]:
    """'a_total{position="0"}' -> ('a_total', {'position': '0'}); 'b' -> ('b', {}). Values may
    hold commas (lora_requests_info's adapter lists) and backslash-escaped quotes."""
    if not key.endswith("}") or "{" not in key:
        return key, {}
    name, _, rest = key.partition("{")
    labels = {k: re.sub(r"\\(.)", r"\1", v) for k, v in _LABEL.findall(rest[:-1])}
    return name, labels


def _histogram_family(name: str, doc: str, data: HistogramData, label: list[str]) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    cumulative, running = [], 0
    for bound, count in zip((*map(float, data.buckets), float("inf")), data.counts, strict=True):
        running += count
        cumulative.append((_le(bound), running))
    family.add_metric(label, cumulative, sum_value=data.sum)
    return family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class ServerMetrics:
    """One registry per server: engine gauges/counters, the engine's per-step histograms, the
    per-request histograms observed here, and the process collectors."""

    def __init__(self, snapshot: Callable[[], dict[str, float]], model_name: str = "tessera",
                 stats: Callable[[], StatsSnapshot] | None = None) -> None:
        disable_created_metrics()  # no `*_created` series (process-wide, as vLLM does)
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot, model_name, stats))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("tessera:time_to_first_token_seconds",
                              "Time from arrival to the first output token.", _LATENCY_BUCKETS)
        self.e2e = histogram("tessera:e2e_request_latency_seconds",
                             "Time from arrival to the last output token.", _REQUEST_TIME_BUCKETS)
        self.queue = histogram("tessera:request_queue_time_seconds",
                               "Time from arrival to first being scheduled.", _REQUEST_TIME_BUCKETS)
        self.prefill = histogram("tessera:request_prefill_time_seconds",
                                 "Time from first being scheduled to the first output token.",
                                 _REQUEST_TIME_BUCKETS)
        self.decode = histogram("tessera:request_decode_time_seconds",
                                "Time from the first output token to the last.",
                                _REQUEST_TIME_BUCKETS)
        self.inference = histogram("tessera:request_inference_time_seconds",
                                   "Time from first being scheduled to the last output token.",
                                   _REQUEST_TIME_BUCKETS)
        self.tpot_request = histogram(
            "tessera:request_time_per_output_token_seconds",
            "Mean time between output tokens of a request, after the first.", _TPOT_BUCKETS)
        self.prompt_tokens = histogram("tessera:request_prompt_tokens",
                                       "Prompt tokens per finished request.", _TOKEN_BUCKETS)
        self.generation_tokens = histogram("tessera:request_generation_tokens",
                                           "Generated tokens per finished request (all n).",
                                           _TOKEN_BUCKETS)

    def observe_finished(self, output: RequestOutput) -> None:
        """Record the latencies and sizes of a request that just finished (aborted ones never
        come here; the engine counts them in request_success_total)."""
        m = output.metrics
        if output.error is not None or m.first_token_time is None:
            return
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        num_generated = m.num_generation_tokens
        if num_generated is None:  # an engine that does not count: CUMULATIVE/FINAL outputs
            num_generated = sum(len(o.token_ids) for o in output.outputs)
        self.generation_tokens.observe(num_generated)
        self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            self.prefill.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        end = m.finished_time or m.last_token_time
        if end is None:
            return
        self.e2e.observe(max(0.0, end - m.arrival_time))
        last = m.last_token_time or end
        self.decode.observe(max(0.0, last - m.first_token_time))
        if m.first_scheduled_time is not None:
            self.inference.observe(max(0.0, last - m.first_scheduled_time))
        num_tokens = num_generated // max(1, len(output.outputs))  # per sequence
        if num_tokens > 1:
            self.tpot_request.observe(max(0.0, last - m.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
