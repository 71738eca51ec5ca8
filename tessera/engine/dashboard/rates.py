"""Rolling rates over the last `window_s` seconds, from the counters of successive samples and from
the requests that finished: output tok/s, TTFT and TPOT p50/p99, preemptions, prefix hit rate.

Kept off the engine thread: the server feeds it on the event loop (samples as they arrive,
finished requests from `AsyncLLMEngine.on_finished`), the simulator on its virtual clock. TTFT is
first token minus arrival; TPOT is (last token - first token) / (tokens - 1) per sequence, as
`/metrics` counts them (tessera/engine/metrics.py).
"""

from __future__ import annotations

from collections import deque
from typing import Any

DEFAULT_WINDOW_S = 10.0


class RollingRates:
    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: deque[tuple[float, dict[str, int]]] = deque()  # (time, counters)
        self._finished: deque[tuple[float, float, float | None]] = deque()  # (end, ttft, tpot)

    def observe_finished(self, end: float, ttft: float, tpot: float | None) -> None:
        """A finished request (seconds, on the samples' clock); `tpot` None for one token."""
        finished = self._finished
        finished.append((end, ttft, tpot))
        while finished[0][0] < end - self.window_s:  # bounded while no page reads the rates
            finished.popleft()

    def observe_output(self, output: Any) -> None:
        """A finished `RequestOutput` (its engine-clock metrics; no text is read)."""
        m = output.metrics
        if output.error is not None or m is None or m.first_token_time is None:
            return
        last = m.last_token_time or m.finished_time or m.first_token_time
        num = m.num_generation_tokens
        if num is None:
            num = sum(len(o.token_ids) for o in output.outputs)
        num //= max(1, len(output.outputs))  # per sequence
        tpot = (last - m.first_token_time) / (num - 1) if num > 1 else None
        self.observe_finished(m.finished_time or last, m.first_token_time - m.arrival_time, tpot)

    def rates(self, now: float, counters: dict[str, int]) -> dict[str, Any]:
        """Add the sample at `now` and return the rates over the window ending there."""
        samples = self._samples
        samples.append((now, dict(counters)))
        start = now - self.window_s
        # keep one sample at or before the window's start, to difference against; one older
        # than two windows is from before a gap (no page was open): start afresh
        while len(samples) > 1 and (samples[1][0] <= start or samples[0][0] < start - self.window_s):
            samples.popleft()
        finished = self._finished
        while finished and finished[0][0] < start:
            finished.popleft()
        t0, first = samples[0]
        span = now - t0

        def delta(name: str) -> int:
            return counters.get(name, 0) - first.get(name, 0)

        queries = delta("prefix_cache_queries")
        ttft = sorted(f[1] for f in finished)
        tpot = sorted(f[2] for f in finished if f[2] is not None)
        return {
            "window_s": self.window_s,
            "span_s": span,
            "output_tok_s": delta("generation_tokens") / span if span > 0 else None,
            "prompt_tok_s": delta("prompt_tokens") / span if span > 0 else None,
            "preemptions": delta("preemptions"),
            "preemptions_swap": delta("swap_preemptions"),
            "preemptions_recompute": delta("preemptions") - delta("swap_preemptions"),
            "preemptions_total": counters.get("preemptions", 0),
            "prefix_hit_rate": delta("prefix_cache_hits") / queries if queries else None,
            "num_finished": len(ttft),
            "ttft_p50_ms": _percentile_ms(ttft, 50),
            "ttft_p99_ms": _percentile_ms(ttft, 99),
            "tpot_p50_ms": _percentile_ms(tpot, 50),
            "tpot_p99_ms": _percentile_ms(tpot, 99),
        }


def _percentile_ms(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted `values`, in ms (None when empty)."""
    if not values:
        return None
    k = max(0, min(len(values) - 1, -(-len(values) * q // 100) - 1))
    return 1e3 * values[int(k)]
