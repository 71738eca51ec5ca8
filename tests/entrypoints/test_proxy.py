"""`tessera proxy` against fake prefill and decode instances (no model): what it sends where,
round-robin, the fallbacks, and its errors."""

from __future__ import annotations

import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tessera.entrypoints.proxy import DisaggProxy, build_app

from .conftest import UvicornThread, free_port


def fake(name: str, seen: list, fail: bool = False, stream_breaks: bool = False) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def handle(request: Request):
        body = await request.json()
        seen.append((name, body))
        if fail:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if body.get("stream"):
            async def events():
                yield b'data: {"choices": [{"text": "a"}]}\n\n'
                if stream_breaks:
                    raise RuntimeError("the decode engine died")
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        answer = {"choices": [{"text": name}]}
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = {"do_remote_prefill": True, "from": name}
        return answer

    return app


def post(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 8, **body},
                      timeout=30)


def test_prefill_then_decode_round_robin():
    seen: list = []
    with UvicornThread(fake("p0", seen)) as p0, UvicornThread(fake("p1", seen)) as p1, \
            UvicornThread(fake("d0", seen)) as d0, UvicornThread(fake("d1", seen)) as d1, \
            UvicornThread(build_app(DisaggProxy([p0.url, p1.url], [d0.url, d1.url]))) as proxy:
        answers = [post(proxy.url, min_tokens=2, stream_options=None).json() for _ in range(4)]
    assert [a["choices"][0]["text"] for a in answers] == ["d0", "d1", "d0", "d1"]
    prefills = [(n, b) for n, b in seen if n.startswith("p")]
    decodes = [(n, b) for n, b in seen if n.startswith("d")]
    assert [n for n, _ in prefills] == ["p0", "p1", "p0", "p1"]
    for _, body in prefills:
        assert body["max_tokens"] == 1 and body["stream"] is False and "min_tokens" not in body
        assert body["kv_transfer_params"] == {"do_remote_decode": True}
    for (_, body), p in zip(decodes, ["p0", "p1", "p0", "p1"], strict=True):
        assert body["max_tokens"] == 8 and body["min_tokens"] == 2
        assert body["kv_transfer_params"] == {"do_remote_prefill": True, "from": p}


def test_failing_or_dead_prefill_means_local_prefill():
    seen: list = []
    dead = f"http://127.0.0.1:{free_port()}"
    with UvicornThread(fake("p", seen, fail=True)) as bad, UvicornThread(fake("d", seen)) as d:
        for prefill in (bad.url, dead):
            seen.clear()
            proxy = DisaggProxy([prefill], [d.url], prefill_timeout=5)
            with UvicornThread(build_app(proxy)) as px:
                r = post(px.url)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "d"
            assert "kv_transfer_params" not in seen[-1][1]
            assert proxy.num_prefill_fallbacks == 1


def test_n_and_batches_skip_the_prefill_instance():
    seen: list = []
    with UvicornThread(fake("p", seen)) as p, UvicornThread(fake("d", seen)) as d, \
            UvicornThread(build_app(DisaggProxy([p.url], [d.url]))) as proxy:
        post(proxy.url, n=2)
        post(proxy.url, prompt=["a", "b"])
    assert [n for n, _ in seen] == ["d", "d"]


def test_dead_decode_is_skipped_then_a_clean_502():
    seen: list = []
    dead = f"http://127.0.0.1:{free_port()}"
    with UvicornThread(fake("p", seen)) as p, UvicornThread(fake("d", seen)) as d:
        with UvicornThread(build_app(DisaggProxy([p.url], [dead, d.url]))) as proxy:
            assert [post(proxy.url).json()["choices"][0]["text"] for _ in range(2)] == ["d", "d"]
        with UvicornThread(build_app(DisaggProxy([p.url], [dead]))) as proxy:
            r = post(proxy.url)
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["code"] == "bad_gateway" and error["type"] == "server_error"


def test_a_decode_stream_that_breaks_ends_with_an_error_event():
    seen: list = []
    with UvicornThread(fake("p", seen)) as p, \
            UvicornThread(fake("d", seen, stream_breaks=True)) as d, \
            UvicornThread(build_app(DisaggProxy([p.url], [d.url]))) as proxy, \
            httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[0].startswith('data: {"choices"')
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "bad_gateway"
    assert seen[0][1]["stream"] is False  # the prefill request is never a stream


def test_bad_json_is_a_400():
    with UvicornThread(
        build_app(DisaggProxy(["http://127.0.0.1:1"], ["http://127.0.0.1:1"]))
    ) as px:
        r = httpx.post(px.url + "/v1/completions", content=b"{not json", timeout=10,
                       headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
