"""/metrics as a vLLM dashboard reads it (fake engine, real uvicorn on 127.0.0.1): every series
with `model_name`, request_success_total by reason, the per-request histograms, per-token TPOT,
process metrics; and the periodic log line."""

from __future__ import annotations

import logging
import re
import time

import httpx
import openai
import pytest

from tessera.engine.stat_logger import StatLogger

from .conftest import serve_fake
from .test_server import open_request

MODEL = 'model_name="fake-model"'
EVERY_LETTER = [chr(c) for c in range(ord("a"), ord("z") + 1)][:4]  # OpenAI allows 4 stops
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


@pytest.fixture(scope="module")
def server():
    srv, engine = serve_fake()
    with srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=10)


def scrape(server) -> dict[str, float]:
    """{'name{labels}': value} with labels as exposed, model_name dropped (asserted present)."""
    values = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, labels, value = _SAMPLE.match(line).groups()
        if name.startswith("tessera:"):
            assert MODEL in (labels or ""), line
            labels = labels.replace(MODEL, "").replace("{,", "{").replace(",}", "}")
            labels = "" if labels == "{}" else labels
        values[name + (labels or "")] = float(value)
    return values


def _delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_every_series_is_exposed_with_its_type(server, client):
    client.completions.create(model="fake-model", prompt="hello", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name, kind in [
        ("request_success_total", "counter"), ("prompt_tokens_cached_total", "counter"),
        ("request_prompt_tokens", "histogram"), ("request_generation_tokens", "histogram"),
        ("request_queue_time_seconds", "histogram"), ("request_prefill_time_seconds", "histogram"),
        ("request_decode_time_seconds", "histogram"),
        ("request_inference_time_seconds", "histogram"),
        ("inter_token_latency_seconds", "histogram"),
        ("time_per_output_token_seconds", "histogram"),
        ("iteration_tokens_total", "histogram"), ("time_to_first_token_seconds", "histogram"),
        ("e2e_request_latency_seconds", "histogram"),
        ("num_requests_running", "gauge"), ("kv_cache_usage_perc", "gauge"),
    ]:
        assert f"# TYPE tessera:{name} {kind}" in text, name
    values = scrape(server)  # asserts model_name on every tessera: sample
    assert values['tessera:request_success_total{finished_reason="length"}'] >= 1
    assert "process_resident_memory_bytes" in values and "process_cpu_seconds_total" in values
    assert any(k.startswith("python_info") for k in values)


def test_counts_for_a_known_set_of_requests(server, client):
    before = scrape(server)
    client.completions.create(model="fake-model", prompt="hi", max_tokens=4)
    stream = client.completions.create(model="fake-model", prompt="hey", max_tokens=5,
                                       stream=True)
    assert [c.choices[0].finish_reason for c in stream][-1] == "length"
    stop = client.completions.create(model="fake-model", prompt="yo", max_tokens=9,
                                     stop=EVERY_LETTER)
    finish = stop.choices[0].finish_reason
    after = scrape(server)
    assert _delta(after, before, 'tessera:request_success_total{finished_reason="length"}') == 2
    assert _delta(after, before, 'tessera:request_success_total{finished_reason="stop"}') == (
        1 if finish == "stop" else 0)
    assert _delta(after, before, "tessera:request_prompt_tokens_count") == 3
    assert _delta(after, before, "tessera:request_prompt_tokens_sum") == 2 + 3 + 2
    stop_tokens = stop.usage.completion_tokens
    assert _delta(after, before, "tessera:request_generation_tokens_sum") == 4 + 5 + stop_tokens
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert _delta(after, before, f"tessera:request_{name}_seconds_count") == 3, name
    # per token, after each request's first: (4-1) + (5-1) + (stop_tokens-1)
    per_token = 3 + 4 + (stop_tokens - 1)
    assert _delta(after, before, "tessera:time_per_output_token_seconds_count") == per_token
    assert _delta(after, before, "tessera:inter_token_latency_seconds_count") == per_token
    assert _delta(after, before, "tessera:time_per_output_token_seconds_sum") > 0
    # one request per step here: each step scheduled one token of one request
    assert _delta(after, before, "tessera:iteration_tokens_total_sum") == 4 + 5 + stop_tokens
    assert _delta(after, before, 'tessera:iteration_tokens_total_bucket{le="1.0"}') > 0


def test_stat_logger_line(caplog):
    now = [0.0]
    log = StatLogger(interval_s=10.0, clock=lambda: now[0])
    m = {"tessera:prompt_tokens_total": 0.0, "tessera:generation_tokens_total": 0.0}
    caplog.set_level(logging.INFO, logger="tessera.engine.stats")
    now[0] = 5.0
    assert not log.maybe_log(m, busy=True)  # interval not up
    now[0] = 10.0
    busy = {"tessera:prompt_tokens_total": 200.0, "tessera:generation_tokens_total": 50.0,
            "tessera:num_requests_running": 3.0, "tessera:num_requests_waiting": 2.0,
            "tessera:kv_cache_usage_perc": 0.25, "tessera:prefix_cache_queries_total": 100.0,
            "tessera:prefix_cache_hits_total": 40.0}
    assert log.maybe_log(busy, busy=True)
    line = caplog.records[-1].getMessage()
    assert "Avg prompt throughput: 20.0 tokens/s" in line
    assert "Avg generation throughput: 5.0 tokens/s" in line
    assert "Running: 3 reqs" in line and "Waiting: 2 reqs" in line
    assert "KV cache usage: 25.0%" in line and "Prefix cache hit rate: 40.0%" in line
    now[0] = 25.0
    n = len(caplog.records)
    assert not log.maybe_log(busy, busy=False)  # idle and nothing new: quiet
    assert len(caplog.records) == n


def test_server_logs_the_line_while_busy(caplog):
    caplog.set_level(logging.INFO, logger="tessera.engine.stats")
    srv, engine = serve_fake()
    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=10)
        stat_logger = srv.server.config.app.state.engine.stat_logger
        stat_logger.interval_s = 0.0  # every step
        client.completions.create(model="fake-model", prompt="hi", max_tokens=3)
    lines = [r.getMessage() for r in caplog.records if r.name == "tessera.engine.stats"]
    assert any("Avg generation throughput" in line and "Running: " in line for line in lines)


def test_a_disconnect_counts_as_abort(server):
    engine = server.engine
    engine.wait_until(lambda: not engine.requests)
    before = scrape(server)
    aborted = engine.num_aborted
    sock = open_request(server.url, "/v1/completions",
                        {"prompt": "hi", "max_tokens": 100, "ignore_eos": True})
    engine.wait_until(lambda: engine.requests)  # it reached the engine
    sock.close()
    engine.wait_until(lambda: engine.num_aborted > aborted)
    key = 'tessera:request_success_total{finished_reason="abort"}'
    for _ in range(100):
        if _delta(scrape(server), before, key) == 1:
            break
        time.sleep(0.05)
    assert _delta(scrape(server), before, key) == 1
