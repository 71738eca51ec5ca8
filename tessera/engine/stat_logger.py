"""vLLM's periodic engine log line: every `interval_s` (10 s) while there is work, throughput over
the interval and the queue and cache state now, from `LLMEngine.get_metrics()` snapshots. An
operator tailing the log sees what the dashboards would show, without Prometheus.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger("tessera.engine.stats")

DEFAULT_INTERVAL_S = 10.0


class StatLogger:
    """Call `maybe_log` after each step (cheap: a clock read unless the interval is up)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._last_time = clock()
        self._last: dict[str, float] = {}

    def maybe_log(self, metrics: dict[str, float], busy: bool) -> bool:
        """Log if the interval is up and there was work (now, or since the last line)."""
        now = self.clock()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return False
        prev = self._last

        def delta(name: str) -> float:
            return metrics.get(name, 0.0) - prev.get(name, 0.0)

        prompt, generated = delta("tessera:prompt_tokens_total"), delta(
            "tessera:generation_tokens_total")
        if not busy and not prompt and not generated:
            self._last_time, self._last = now, dict(metrics)
            return False
        queries = delta("tessera:prefix_cache_queries_total")
        hit_rate = delta("tessera:prefix_cache_hits_total") / queries if queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Swapped: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "CPU swap usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt / elapsed, generated / elapsed,
            metrics.get("tessera:num_requests_running", 0.0),
            metrics.get("tessera:num_requests_swapped", 0.0),
            metrics.get("tessera:num_requests_waiting", 0.0),
            100 * metrics.get("tessera:kv_cache_usage_perc", 0.0),
            100 * metrics.get("tessera:cpu_cache_usage_perc", 0.0),
            100 * hit_rate,
        )
        self._last_time, self._last = now, dict(metrics)
        return True
