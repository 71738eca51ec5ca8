"""Arrival statistics, SSE parsing, metrics on synthetic timings, goodput and the outputs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tessera.bench.client import arrival_times, parse_sse_line
from tessera.bench.report import (
    RequestResult,
    compute_metrics,
    format_table,
    meets_slos,
    parse_goodput,
    plot_cdfs,
    result_json,
    save_json,
)


def _gaps(rate: float, burstiness: float, n: int = 20_000) -> np.ndarray:
    t = arrival_times(n, rate, burstiness, seed=0)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    return np.diff(t)


def test_poisson_arrivals_have_mean_interval_one_over_rate():
    gaps = _gaps(rate=10.0, burstiness=1.0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_the_spread(burstiness):
    gaps = _gaps(rate=5.0, burstiness=burstiness)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    # gamma with shape k: coefficient of variation 1 / sqrt(k)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_arrivals_infinite_rate_seed_and_validation():
    assert np.all(arrival_times(7, math.inf) == 0.0)
    assert np.array_equal(arrival_times(5, 2.0, seed=1), arrival_times(5, 2.0, seed=1))
    assert not np.array_equal(arrival_times(5, 2.0, seed=1), arrival_times(5, 2.0, seed=2))
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="--burstiness"):
        arrival_times(3, 1.0, burstiness=0.0)


def test_parse_sse_line():
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data:[DONE]") == "[DONE]"
    assert parse_sse_line("") is None and parse_sse_line(": ping") is None
    assert parse_sse_line("event: message") is None


def _synthetic() -> list[RequestResult]:
    return [
        # 5 tokens: ttft 100 ms, 4 gaps of 50 ms, e2e 300 ms -> tpot 50 ms
        RequestResult(True, 10, 5, 0.100, [0.05] * 4, 0.300),
        # 3 tokens: ttft 200 ms, gaps 100/300 ms, e2e 600 ms -> tpot 200 ms
        RequestResult(True, 20, 3, 0.200, [0.1, 0.3], 0.600),
        # 1 token: no TPOT, no ITL
        RequestResult(True, 30, 1, 0.050, [], 0.050),
        RequestResult(False, 40, 0, error="HTTP 500: boom"),
    ]


def test_metrics_on_synthetic_timings():
    m = compute_metrics(_synthetic(), duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["mean_ttft_ms"] == pytest.approx(350 / 3)
    assert m["median_ttft_ms"] == pytest.approx(100)
    assert m["mean_tpot_ms"] == pytest.approx(125)  # (50 + 200) / 2: the 1-token request has none
    assert m["mean_itl_ms"] == pytest.approx(1000 * (0.2 + 0.4) / 6)
    assert m["median_itl_ms"] == pytest.approx(50)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile([50, 50, 50, 50, 100, 300], 99))
    assert m["p90_e2el_ms"] == pytest.approx(np.percentile([300, 600, 50], 90))
    assert m["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    results = _synthetic()
    assert parse_goodput(["ttft:150", "tpot:100"]) == {"ttft": 150.0, "tpot": 100.0}
    assert [meets_slos(r, {"ttft": 150.0, "tpot": 100.0}) for r in results] == [
        True, False, True, False]
    m = compute_metrics(results, 2.0, {"e2el": 500.0})
    assert m["request_goodput"] == pytest.approx(1.0)  # 2 requests within 500 ms, over 2 s
    assert compute_metrics(results, 2.0, {"ttft": 1.0})["request_goodput"] == 0.0
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_no_successes_gives_zeros_not_errors():
    m = compute_metrics([RequestResult(False, error="x")], 1.0, {"ttft": 10.0})
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["request_goodput"] == 0.0


def test_table_json_and_plot(tmp_path):
    results = _synthetic()
    m = compute_metrics(results, 2.0, {"ttft": 150.0})
    table = format_table(m)
    for line in ("Successful requests:", "Failed requests:", "Request goodput (req/s):",
                 "P99 TPOT (ms):", "Median ITL (ms):", "Mean E2EL (ms):"):
        assert line in table
    path = tmp_path / "r.json"
    save_json(str(path), result_json(m, results, {"request_rate": "inf"}))
    data = json.loads(path.read_text())
    assert data["metrics"]["completed"] == 3 and len(data["requests"]) == 4
    assert data["requests"][0]["tpot"] == pytest.approx(0.05)
    assert data["requests"][3]["error"] == "HTTP 500: boom"
    pytest.importorskip("matplotlib")
    plot = tmp_path / "cdf.png"
    plot_cdfs(str(plot), results, title="synthetic")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
