"""Bounded work before admission and errors in one shape, against the fake engine (fast): body
limit (413), text checks before tokenization, /health while a huge prompt is refused, refused
streams are HTTP errors, `code` a string or null, no internal text, auth on the docs."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tessera.engine.async_engine import AsyncLLMEngine
from tessera.entrypoints.openai.server import build_app

from .conftest import UvicornThread, probe_health_while, serve_fake
from .fake_engine import FakeEngine

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(max_model_len=128)
    with UvicornThread(build_app(AsyncLLMEngine(engine), max_request_body_bytes=LIMIT)) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] is None or isinstance(err["code"], str)
    return err


def test_body_over_the_limit_is_413_declared_or_chunked(http):
    big = json.dumps({"prompt": "x" * (LIMIT + 1)})
    err = _error(http.post("/v1/completions", content=big,
                           headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large" and "--max-request-body-bytes" in err["message"]

    def chunks():  # no Content-Length: the limit applies as the bytes arrive
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192].encode()

    _error(http.post("/v1/completions", content=chunks(),
                     headers={"content-type": "application/json"}), 413)
    # under the limit, the same route still works
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_text_too_long_for_the_context_is_refused_before_tokenizing(server, http, monkeypatch):
    from tessera.entrypoints.openai import preprocess

    calls = []
    original = preprocess.Preprocessor._run

    async def spy(self, fn, *args):
        calls.append(fn)
        return await original(self, fn, *args)

    monkeypatch.setattr(preprocess.Preprocessor, "_run", spy)
    # the fake's tokens are bytes: 129 characters can never fit in 128 tokens
    err = _error(http.post("/v1/completions", json={"prompt": "y" * 129}), 400)
    assert err["param"] == "prompt" and "maximum context length is 128" in err["message"]
    err = _error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "z" * 60}, {"role": "user", "content": "z" * 70}]
    }), 400)
    assert err["param"] == "messages.1.content"
    assert calls == []  # neither was tokenized
    assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200
    assert calls  # while a prompt that may fit is


def test_tokenization_runs_off_the_event_loop(monkeypatch):
    from .fake_engine import FakeTokenizer

    encode = FakeTokenizer.encode

    def slow_encode(self, text, add_special_tokens=True):
        if text.startswith("slow"):
            time.sleep(0.5)  # a costly tokenization: on the event loop it would stall /health
        return encode(self, text, add_special_tokens)

    monkeypatch.setattr(FakeTokenizer, "encode", slow_encode)
    with UvicornThread(build_app(AsyncLLMEngine(FakeEngine()))) as srv:
        latencies, status = probe_health_while(srv.url, lambda: httpx.post(
            srv.url + "/v1/completions", json={"prompt": "slow one", "max_tokens": 2},
            timeout=30).status_code)
    assert status == 200 and len(latencies) > 3
    assert max(latencies) < 0.1, f"/health took up to {max(latencies) * 1e3:.0f} ms"


def test_health_answers_while_a_huge_prompt_is_refused():
    """A 5 MB prompt against default flags is a 413 before its body is read;
    /health probes meanwhile answer within 100 ms. (Under the limit, a huge prompt is refused by
    its length before tokenization: tests/reliability, 3 MB on the real server.)"""
    engine = FakeEngine(max_model_len=128)
    app = build_app(AsyncLLMEngine(engine))
    body = json.dumps({"prompt": "w" * (5 * 2**20), "max_tokens": 4}).encode()
    with UvicornThread(app) as srv:
        latencies, status = probe_health_while(srv.url, lambda: httpx.post(
            srv.url + "/v1/completions", content=body,
            headers={"content-type": "application/json"}, timeout=60).status_code)
    assert status == 413
    assert max(latencies) < 0.1, f"/health took up to {max(latencies) * 1e3:.0f} ms"


def test_refused_stream_is_an_http_error(http):
    # refused at admission (by the engine's own checks): no 200, no event stream
    r = http.post("/v1/completions", json={"prompt": "hi", "stream": True, "max_tokens": 500})
    err = _error(r, 400)
    assert err["param"] == "max_tokens"
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 100})
    assert _error(r, 400)["param"] == "n"
    r = http.post("/v1/completions", json={"prompt": "hi", "stream": True, "logprobs": 21})
    err = _error(r, 400)
    assert err["param"] == "logprobs" and "--max-logprobs" in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "top_k": 1180591620717411303424}, "top_k"),
    ({"prompt": "hi", "seed": 18446744073709551616}, "seed"),
    ({"prompt": "hi", "max_tokens": 2**63}, "max_tokens"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": "hi", "stop": ["s"] * 17}, "stop"),
    ({"prompt": "hi", "stop": "x" * 1025}, "stop"),
    ({"prompt": "hi", "n": 2**40}, "n"),
    ({"prompt": "hi", "repetition_penalty": 1e308}, "repetition_penalty"),
])
def test_out_of_range_is_400_naming_the_field(http, body, param):
    err = _error(http.post("/v1/completions", json=body), 400)
    assert err["param"] is not None and err["param"].startswith(param), err


def test_error_shape_and_no_internal_text(http):
    # a lone surrogate is valid JSON but not Unicode: named, not the tokenizer's TypeError
    for path, raw, param in (
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
             "messages.0.content"),
            ("/v1/completions", '{"prompt": "\\udfff"}', "prompt")):
        err = _error(http.post(path, content=raw, headers={"content-type": "application/json"}),
                     400)
        assert err["param"] == param, err
        assert "surrogate" in err["message"] or "unicode" in err["message"], err
        assert "TextEncodeInput" not in err["message"]
    for path, needed in (("/v1/completions", "'prompt'"), ("/v1/chat/completions", "'messages'")):
        for content in (b"", None):
            err = _error(http.post(path, content=content,
                                   headers={"content-type": "application/json"}), 400)
            assert "body is missing" in err["message"] and needed in err["message"], err
            assert "None" not in err["message"]
    assert _error(http.get("/v1/nothing"), 404)["code"] is None
    assert _error(http.get("/v1/completions"), 405)["code"] is None


def test_docs_need_the_key_and_probes_stay_open():
    srv, _ = serve_fake(api_key="sk-rel")
    with srv:
        for path in ("/docs", "/redoc", "/openapi.json", "/v1/models", "/nothing"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            ok = httpx.get(srv.url + path, headers={"Authorization": "Bearer sk-rel"})
            assert ok.status_code == (404 if path == "/nothing" else 200), path
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(srv.url + path).status_code == 200, path
