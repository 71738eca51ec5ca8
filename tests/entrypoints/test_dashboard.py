"""/dashboard and /dashboard/events on a real uvicorn: behind --api-key (header or ?api_key=),
absent with --disable-dashboard, samples no more often than --dashboard-interval, and the load
shows in them (the real engine over a tiny random Llama, prompts as token ids)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import httpx
import pytest

from tessera.engine.async_engine import AsyncLLMEngine
from tessera.entrypoints.cli import build_parser
from tessera.entrypoints.openai.server import build_app

from .conftest import UvicornThread, serve_fake
from .fake_engine import FakeEngine

KEY = "sk-dashboard"
AUTH = {"Authorization": f"Bearer {KEY}"}
INTERVAL_MS = 100


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tessera.config import EngineArgs
    from tessera.engine.llm_engine import LLMEngine
    from tests.tiny_llama import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(str(path), num_kv_heads=2)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path), max_model_len=256,
                                                   max_num_batched_tokens=256, max_num_seqs=4,
                                                   num_gpu_blocks_override=48, block_size=8))
    app = build_app(AsyncLLMEngine(engine), api_key=KEY, dashboard_interval_ms=INTERVAL_MS)
    with UvicornThread(app) as srv:
        yield srv


def read_samples(url: str, count: int, params: dict | None = None,
                 headers: dict | None = None, timeout: float = 60) -> list[dict]:
    """The first `count` samples of the event stream."""
    samples = []
    with httpx.stream("GET", url + "/dashboard/events", params=params, headers=headers,
                      timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                samples.append(json.loads(line[len("data: "):]))
                if len(samples) == count:
                    break
    return samples


def test_page_and_events_need_the_key(server):
    for path in ("/dashboard", "/dashboard/events"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(server.url + path, params={"api_key": "wrong"}, timeout=10)
        assert r.status_code == 401
    # the key as a query parameter is for these two routes only
    assert httpx.get(server.url + "/v1/models", params={"api_key": KEY}).status_code == 401
    page = httpx.get(server.url + "/dashboard", headers=AUTH, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert 'id="tessera-boot"' in html and "dashboard/events" in html
    for fetched in ("src=", 'href="http', 'href="/', "https://", "http://"):  # no CDN, no file
        assert fetched not in html
    assert httpx.get(server.url + "/dashboard", params={"api_key": KEY}).status_code == 200
    [sample] = read_samples(server.url, 1, params={"api_key": KEY})
    assert sample["version"] == 1 and sample["kv"]["num_blocks"] == 48


def test_events_show_the_load_without_request_content(server):
    prompts = [[7 + k] * (30 + 10 * k) for k in range(8)]  # 8 requests, 4 seats, 48 blocks:
    # 150 tokens each keep the seats full for many samples, so the queue behind them shows
    done: list[int] = []

    def load() -> None:
        def one(prompt):
            r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=120, json={
                "prompt": prompt, "max_tokens": 150, "ignore_eos": True, "temperature": 0})
            done.append(r.status_code)
        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    loader = threading.Thread(target=load)
    samples = []
    with httpx.stream("GET", server.url + "/dashboard/events", headers=AUTH, timeout=120) as r:
        lines = r.iter_lines()
        loader.start()
        for line in lines:
            if not line.startswith("data: "):
                continue
            raw = line[len("data: "):]
            for banned in ('"prompt"', '"text"', '"token_ids"', '"[7, 7'):
                assert banned not in raw
            samples.append(json.loads(raw))
            if not loader.is_alive():
                break
    loader.join()
    assert done == [200] * 8
    assert max(s["queues"]["running"] for s in samples) >= 2
    assert max(s["queues"]["waiting"] for s in samples) > 0
    assert max(s["kv"]["num_used"] for s in samples) > 0
    assert len({s["kv"]["blocks"] for s in samples}) > 2  # the block map moves
    steps = [st for s in samples for st in s["steps"]]
    assert sum(st["prefill_tokens"] for st in steps) > 0 and sum(
        st["decode_tokens"] for st in steps) > 0
    ids = {row["id"] for s in samples for row in s["requests"]["rows"]}
    assert ids and all(i.startswith("cmpl-") for i in ids)
    last = samples[-1]["rates"]
    assert last["output_tok_s"] is not None and last["num_finished"] > 0
    assert last["ttft_p50_ms"] > 0 and last["tpot_p50_ms"] > 0
    # sampled no more often than --dashboard-interval (the engine clock of each sample)
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(samples)]
    assert min(gaps) >= 0.9 * INTERVAL_MS / 1e3


def test_stream_closed_stops_the_step_recording(server):
    read_samples(server.url, 2, headers=AUTH)
    recorder = server.server.config.app.state.engine.engine.dashboard
    deadline = time.monotonic() + 5
    while recorder.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not recorder.active


def test_disable_dashboard_removes_both_routes():
    engine = FakeEngine()
    with UvicornThread(build_app(AsyncLLMEngine(engine), enable_dashboard=False)) as srv:
        for path in ("/dashboard", "/dashboard/events"):
            assert httpx.get(srv.url + path, timeout=10).status_code == 404
    srv, _ = serve_fake(api_key=KEY)
    with srv:  # on by default; with a key, a page without it is a 401 like any other route
        assert httpx.get(srv.url + "/dashboard", timeout=10).status_code == 401
        assert httpx.get(srv.url + "/dashboard", headers=AUTH, timeout=10).status_code == 200


def test_flags():
    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert (args.disable_dashboard, args.dashboard_interval) == (False, 250)
    args = parser.parse_args(["serve", "--disable-dashboard", "--dashboard-interval", "1000"])
    assert (args.disable_dashboard, args.dashboard_interval) == (True, 1000)
    with pytest.raises(ValueError, match="--dashboard-interval"):
        build_app(AsyncLLMEngine(FakeEngine()), dashboard_interval_ms=5)
