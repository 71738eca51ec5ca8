"""End to end against a fake OpenAI-compatible streaming server on 127.0.0.1: the bench run, its
JSON and figure, the CLI wiring, and a sweep that starts and stops servers itself."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

from tessera.bench import add_bench_parser
from tessera.bench.config import BenchConfig
from tessera.bench.datasets import SampleRequest, sample_random
from tessera.bench.serve import run_bench
from tessera.bench.sweep import plot_sweep, sweep

from .fake_server import CHAT_TEMPLATE_TOKENS, FakeServer
from .fakes import WordTokenizer

FAKE_SERVER = os.path.join(os.path.dirname(__file__), "fake_server.py")


@pytest.fixture
def server():
    s = FakeServer(delay_s=0.002).start()
    yield s
    s.stop()


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tessera")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_bench_against_fake_server(server, tmp_path):
    samples = sample_random(WordTokenizer(), 12, input_len=16, output_len=6, seed=0)
    samples.append(SampleRequest("please FAIL now", 3, 5))
    samples.append(SampleRequest("EMPTY reply", 2, 5))
    cfg = BenchConfig(base_url=server.base_url, request_rate=200.0, max_concurrency=4,
                      ignore_eos=True, slos={"ttft": 10_000.0}, disable_tqdm=True)
    result_file, plot_file = tmp_path / "result.json", tmp_path / "cdf.png"
    run_bench(cfg, samples, WordTokenizer(), str(result_file), str(plot_file), quiet=True)

    data = json.loads(result_file.read_text())
    m = data["metrics"]
    assert (m["completed"], m["failed"]) == (13, 1)  # an empty reply is no failure
    assert m["total_output_tokens"] == 12 * 6 and m["total_input_tokens"] == 12 * 16 + 2
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])
    assert 0 < m["median_ttft_ms"] <= m["p99_e2el_ms"] and m["mean_itl_ms"] > 0
    assert m["mean_tpot_ms"] > 0
    empty = data["requests"][-1]
    assert empty["success"] and empty["output_tokens"] == 0 and empty["tpot"] is None
    assert 0 < empty["ttft"] == empty["e2el"]
    ok = [r for r in data["requests"] if r["success"] and r["output_tokens"]]
    assert all(len(r["itl"]) == 5 and r["generated_text"].startswith("t0 ") for r in ok)
    assert "HTTP 500" in next(r["error"] for r in data["requests"] if not r["success"])
    assert data["config"]["model"] == "fake-model" and "api_key" not in data["config"]
    assert plot_file.read_bytes()[:4] == b"\x89PNG"
    # what the server saw: the probe plus every sample, streamed with usage and ignore_eos
    sent = server.payloads
    assert len(sent) == 15 and sent[0]["max_tokens"] == 4
    assert all(p["stream"] and p["stream_options"] == {"include_usage": True} for p in sent)
    assert all(p["ignore_eos"] is True and p["model"] == "fake-model" for p in sent)
    assert server.max_in_flight <= 4


@pytest.mark.parametrize("usage", [True, False])
def test_bench_chat_endpoint(server, usage):
    """--endpoint /v1/chat/completions: messages out, `delta.content` in, tokens counted as for
    completions (the server's usage, else the tokenizer over the text)."""
    samples = sample_random(WordTokenizer(), 5, input_len=8, output_len=6, seed=0)
    samples.append(SampleRequest("please FAIL now", 3, 5))
    samples.append(SampleRequest("EMPTY reply", 2, 5))
    extra = {} if usage else {"stream_options": {"include_usage": False}}
    cfg = BenchConfig(base_url=server.base_url, endpoint="/v1/chat/completions",
                      extra_body=extra, disable_tqdm=True)
    data = run_bench(cfg, samples, WordTokenizer(), quiet=True)
    m = data["metrics"]
    assert (m["completed"], m["failed"]) == (6, 1)
    assert m["total_output_tokens"] == 5 * 6  # "t0 t1 ..." is one word-token per delta
    overhead = CHAT_TEMPLATE_TOKENS if usage else 0  # usage counts the chat template's tokens
    assert m["total_input_tokens"] == 5 * (8 + overhead) + 2 + overhead
    ok = [r for r in data["requests"] if r["success"] and r["output_tokens"]]
    assert len(ok) == 5
    assert all(r["generated_text"] == "t0 t1 t2 t3 t4 t5 " and len(r["itl"]) == 5 for r in ok)
    assert all(0 < r["ttft"] < r["e2el"] for r in ok)
    empty = data["requests"][-1]
    assert empty["success"] and empty["output_tokens"] == 0 and empty["ttft"] == empty["e2el"]
    sent = server.payloads
    assert len(sent) == 8 and sent[0]["max_completion_tokens"] == 4  # the probe
    assert all("prompt" not in p and "max_tokens" not in p for p in sent)
    # requests run concurrently: they reach the server in any order
    assert sorted(p["messages"][0]["content"] for p in sent[1:]) == sorted(
        s.prompt for s in samples
    )
    assert all(p["messages"] == [{"role": "user", "content": p["messages"][0]["content"]}]
               for p in sent)
    assert all(p["stream"] for p in sent)


def test_endpoint_must_be_a_completions_route():
    with pytest.raises(ValueError, match="--endpoint"):
        BenchConfig(endpoint="/v1/embeddings")


def test_unreachable_server_fails_fast():
    cfg = BenchConfig(base_url="http://127.0.0.1:9", model="m", disable_tqdm=True)
    with pytest.raises(RuntimeError, match="test request"):
        run_bench(cfg, [SampleRequest("hi there", 2, 2)], quiet=True)


def test_cli_parser_registers_serve_and_sweep():
    args = _bench_args("serve", "--base-url", "http://127.0.0.1:1234", "--dataset", "random",
                       "--request-rate", "inf", "--burstiness", "0.5", "--goodput", "ttft:100",
                       "tpot:20", "--ignore-eos")
    assert args.func.__name__ == "_run_serve" and args.request_rate == float("inf")
    assert args.goodput == ["ttft:100", "tpot:20"] and args.ignore_eos
    args = _bench_args("sweep", "--request-rates", "1", "2", "inf",
                       "--settings", "", " --enable-chunked-prefill",
                       "--max-num-batched-tokens 256")
    assert args.func.__name__ == "_run_sweep" and args.request_rates == [1, 2, float("inf")]
    assert args.settings == ["", " --enable-chunked-prefill", "--max-num-batched-tokens 256"]


def test_sweep_starts_and_stops_servers(tmp_path):
    args = _bench_args(
        "sweep", "--dataset", "random", "--request-rates", "50", "inf",
        "--settings", "--delay-ms 1", "--delay-ms 3",
        "--server-cmd", f"{{python}} {FAKE_SERVER} --port {{port}}", "--server-timeout", "20",
        "--disable-tqdm", "--result-dir", str(tmp_path / "points"))
    samples = sample_random(WordTokenizer(), 6, input_len=8, output_len=4, seed=0)
    data = sweep(args, samples, WordTokenizer())
    points = data["points"]
    assert [(p["setting"], p["request_rate"]) for p in points] == [
        ("--delay-ms 1", 50.0), ("--delay-ms 1", "inf"), ("--delay-ms 3", 50.0),
        ("--delay-ms 3", "inf")]
    assert all(p["metrics"]["completed"] == 6 and p["metrics"]["failed"] == 0 for p in points)
    # each point sent 7 requests (probe + 6), seen as a counter difference on /metrics
    assert all(p["server_counters"] == {"fake:requests_total": 7.0} for p in points)
    assert points[0]["server_argv"][:2] == [sys.executable, FAKE_SERVER]
    assert len(list((tmp_path / "points").glob("setting*-rate*.json"))) == 4
    assert len(list((tmp_path / "points").glob("server-*.log"))) == 2
    plot = tmp_path / "sweep.png"
    plot_sweep(str(plot), data)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_sweep_reports_a_server_that_dies(tmp_path):
    args = _bench_args("sweep", "--dataset", "random", "--server-cmd",
                       "{python} -c 'import sys; print(\"bad flag\"); sys.exit(3)'",
                       "--result-dir", str(tmp_path), "--disable-tqdm")
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*bad flag"):
        sweep(args, [SampleRequest("a b c d", 4, 4)], WordTokenizer())


def test_vllm_spellings(tmp_path):
    """`--dataset-name`, `--backend` and `--save-result` (with --result-dir/--result-filename)
    mean what they mean in vLLM's `bench serve`."""
    from tessera.bench.config import config_from_args, result_path

    args = _bench_args("serve", "--dataset-name", "random", "--backend", "openai-chat",
                       "--save-result", "--result-dir", str(tmp_path), "--label", "x",
                       "--request-rate", "2")
    assert args.dataset == "random"
    assert config_from_args(args).endpoint == "/v1/chat/completions"
    path = result_path(args)
    assert path.startswith(str(tmp_path / "x-2.0qps-")) and path.endswith(".json")
    args = _bench_args("serve", "--save-result", "--result-dir", str(tmp_path),
                       "--result-filename", "r.json")
    assert result_path(args) == str(tmp_path / "r.json")
    assert result_path(_bench_args("serve")) is None
    assert config_from_args(_bench_args("serve", "--backend", "vllm")).endpoint == "/v1/completions"
    with pytest.raises(ValueError, match="--backend"):
        config_from_args(_bench_args("serve", "--backend", "openai",
                                     "--endpoint", "/v1/chat/completions"))
