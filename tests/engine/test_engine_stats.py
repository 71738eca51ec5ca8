"""`EngineStats` as `LLMEngine` feeds it (fake executor, a clock the test moves): how requests
finished, one inter-token interval per output token after the first, tokens per step."""

from __future__ import annotations

import zlib

from test_llm_engine import EOS, VOCAB, CharTokenizer, FakeExecutor

from tessera.config import EngineArgs
from tessera.engine.llm_engine import LLMEngine
from tessera.engine.stats import HistogramData
from tessera.sampling.params import RequestOutputKind, SamplingParams

STEP = 0.25  # engine-clock seconds per step


def _engine() -> tuple[LLMEngine, FakeExecutor, list[float]]:
    now = [0.0]
    executor = FakeExecutor()
    config = EngineArgs(max_model_len=128, block_size=4).create_engine_config(128)
    engine = LLMEngine(config, executor, CharTokenizer(), (EOS,), VOCAB, clock=lambda: now[0])
    return engine, executor, now


def _run(engine: LLMEngine, now: list[float]) -> dict:
    finals = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return finals
        now[0] += STEP
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("no progress")


def test_finished_reasons_inter_token_latency_and_iteration_tokens():
    engine, executor, now = _engine()
    delta = RequestOutputKind.DELTA
    engine.add_request("len4", "hello", SamplingParams(max_tokens=4, output_kind=delta))
    engine.add_request("len6", "world!", SamplingParams(max_tokens=6))
    # the fake runner's first token for this prompt (test_llm_engine.FakeExecutor's rule)
    first = chr(97 + zlib.crc32(b"p me") % 26)
    engine.add_request("stop", "stop me", SamplingParams(max_tokens=9, stop=[first]))
    engine.add_request("gone", "never run", SamplingParams(max_tokens=9))
    engine.abort_request("gone")
    engine.abort_request("unknown")  # not a request: not counted
    finals = _run(engine, now)

    stats = engine.get_stats()
    assert stats.finished_reasons == {"length": 2, "stop": 1, "abort": 1}
    assert [finals[r].outputs[0].finish_reason for r in ("len4", "len6", "stop")] == [
        "length", "length", "stop"]
    # the final DELTA output carries one token, its metrics the whole count
    assert len(finals["len4"].outputs[0].token_ids) == 1
    assert finals["len4"].metrics.num_generation_tokens == 4
    assert finals["stop"].metrics.num_generation_tokens == 1

    itl = stats.histograms["inter_token_latency_seconds"]
    assert itl.count == (4 - 1) + (6 - 1) + (1 - 1)  # per token, after each request's first
    assert abs(itl.sum - STEP * itl.count) < 1e-9  # each one step apart on this clock

    tokens = stats.histograms["iteration_tokens_total"]
    scheduled = [m.total_num_scheduled_tokens for m in executor.messages
                 if m.total_num_scheduled_tokens]
    assert tokens.count == len(scheduled) and tokens.sum == sum(scheduled)
    assert engine.get_metrics()["tessera:prompt_tokens_cached_total"] == 0.0


def test_snapshot_is_a_copy():
    engine, _, now = _engine()
    before = engine.get_stats()
    engine.add_request("r", "hi", SamplingParams(max_tokens=3))
    _run(engine, now)
    assert before.histograms["inter_token_latency_seconds"].count == 0
    assert before.finished_reasons == {}
    assert engine.get_stats().finished_reasons == {"length": 1}


def test_histogram_buckets_are_upper_bounds():
    h = HistogramData((1, 8))
    for v in (0.5, 1, 1.5, 8, 9):
        h.observe(v)
    assert h.counts == [2, 2, 1] and h.count == 5 and h.sum == 20.0


def test_resolved_config_line_names_every_field():
    from tessera.engine.loading import describe_config

    config = EngineArgs(max_num_seqs=7).create_engine_config(2048)
    line = describe_config(config)
    assert "scheduler.max_num_seqs=7" in line
    assert "model.max_model_len=2048" in line  # resolved from the model's limit
    assert "cache.block_size=" in line and "device.device=" in line
