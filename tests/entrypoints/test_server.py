"""The HTTP layer against the fake engine: shapes, streaming, indexes, errors, auth, disconnects,
metrics. Fast; the same behaviours against the real model are in test_openai_server.py."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

from .conftest import serve_fake

API_KEY = "sk-test"


@pytest.fixture(scope="module")
def server():
    srv, engine = serve_fake(api_key=API_KEY)
    with srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=10)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=10,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def _letters(start: int, n: int) -> str:
    return "".join(chr(ord("a") + (start + i) % 26) for i in range(n))


def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    assert http.get("/health").status_code == 200
    assert "version" in http.get("/version").json()


def test_completion_basic(client):
    r = client.completions.create(model="fake-model", prompt="hello", max_tokens=5,
                                  temperature=0)
    assert r.choices[0].text == _letters(5, 5)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)


def test_completion_prompt_forms_and_indexes(client):
    r = client.completions.create(model="fake-model", prompt=["ab", "abc"], n=2, max_tokens=3,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [_letters(2, 3)] * 2 + [_letters(3, 3)] * 2
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    r = client.completions.create(model="fake-model", prompt=[104, 105], max_tokens=2,
                                  temperature=0, echo=True)
    assert r.choices[0].text == "hi" + _letters(2, 2)
    r = client.completions.create(model="fake-model", prompt=[[104], [104, 105]], max_tokens=1,
                                  temperature=0)
    assert [c.text for c in r.choices] == [_letters(1, 1), _letters(2, 1)]


def test_completion_stream_matches(client):
    full = client.completions.create(model="fake-model", prompt=["x", "yy"], n=2, max_tokens=6,
                                     temperature=0, stop=["zz"])
    chunks = list(client.completions.create(model="fake-model", prompt=["x", "yy"], n=2,
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    reasons = {}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {c.index: c.finish_reason for c in full.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completion_stop_and_logprobs(client):
    r = client.completions.create(model="fake-model", prompt="abc", max_tokens=10,
                                  temperature=0, stop="fg", logprobs=2)
    c = r.choices[0]
    assert c.text == "de" and c.finish_reason == "stop"
    assert c.logprobs.tokens[:2] == ["d", "e"] and c.logprobs.token_logprobs[0] == -0.5
    assert list(c.logprobs.top_logprobs[0]) == ["d", "A"]
    assert c.logprobs.text_offset[:2] == [0, 1]


def test_seeded_n(client):
    r = client.completions.create(model="fake-model", prompt="a", n=2, max_tokens=3,
                                  temperature=1.0, seed=7)
    assert [c.text for c in r.choices] == [_letters(7, 3), _letters(8, 3)]


def test_chat_and_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=1)
    msg = full.choices[0]
    assert len(msg.message.content) == 4 and msg.message.role == "assistant"
    assert [t.token for t in msg.logprobs.content] == list(msg.message.content)
    assert msg.logprobs.content[0].top_logprobs[0].logprob == -0.5
    prompt_len = len("<system>be brief\n<user>hi\n<assistant>")
    assert full.usage.prompt_tokens == prompt_len and full.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(
        model="fake-model", messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        msg.message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 4
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_chat_default_max_tokens_fills_context(client):
    r = client.chat.completions.create(model="fake-model", temperature=0,
                                       messages=[{"role": "user", "content": "x" * 100}])
    assert r.usage.total_tokens == 128 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, status, fragment", [
    ('{"prompt": "hi", ', 400, "malformed JSON"),
    ("[1, 2]", 400, "JSON object"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": 9}, 400, "--max-num-seqs"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "suffix": "x"}, 400, "infill"),
    ({"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream=true"),
    ({"prompt": ""}, 400, "prompt: String should have at least 1 character"),
    ({"prompt": []}, 400, "prompt: "),
    ({"prompt": [300]}, 400, "vocabulary"),
    ({"prompt": "x" * 120, "max_tokens": 10}, 400, "maximum context length is 128"),
    ({"prompt": "hi", "model": "nope"}, 404, "nope"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ({"prompt": "hi", "priority": 1}, 400, "--scheduling-policy priority"),
])
def test_completion_errors(http, body, status, fragment):
    if isinstance(body, str):
        r = http.post("/v1/completions", content=body,
                      headers={"Content-Type": "application/json"})
    else:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"]


@pytest.mark.parametrize("body, fragment", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "logprobs=true"),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, "maximum context length is 128"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 500}, "500"),
    ({"messages": [{"role": "user", "content": "x"}], "priority": -1}, "priority (-1)"),
])
def test_chat_errors(http, body, fragment):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_priority_needs_the_priority_policy(http, path, body):
    body = {**body, "max_tokens": 2}
    for priority in (1, -3):  # fcfs would ignore it: refused, as vLLM does
        r = http.post(path, json={**body, "priority": priority})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
    assert http.post(path, json={**body, "priority": 0}).status_code == 200
    srv, engine = serve_fake(scheduling_policy="priority")
    with srv:
        r = httpx.post(srv.url + path, json={**body, "priority": 5}, timeout=10)
    assert r.status_code == 200, r.text
    assert engine.priorities == [5]


def test_auth(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_is_openai_shaped(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def _metric(http, name: str) -> float:
    """The value of the series `name` (labels as exposed, less the model_name every series has)."""
    for line in http.get("/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.replace('model_name="fake-model"', "").replace(",}", "}").replace(
                "{,", "{").removesuffix("{}") == name:
            return float(value)
    raise AssertionError(f"{name} not exposed")


def open_request(url: str, path: str, body: dict, api_key: str | None = None) -> socket.socket:
    """Send a POST on a raw socket and return it unread: closing it is a client disconnect."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"{auth}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts(server, http, stream):
    engine = server.engine
    engine.wait_until(lambda: not engine.requests)  # the previous case has cleaned up
    aborted = engine.num_aborted
    body = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": stream}
    sock = open_request(server.url, "/v1/completions", body, API_KEY)
    if stream:
        received = b""
        while b"data: " not in received:  # wait for the first tokens
            chunk = sock.recv(4096)
            assert chunk, "connection closed early"
            received += chunk
    else:
        engine.wait_until(lambda: engine.requests)  # it reached the engine
    sock.close()
    engine.wait_until(lambda: engine.num_aborted > aborted)
    assert engine.num_aborted == aborted + 1 and not engine.requests


def test_metrics_exposition(client, http):
    client.completions.create(model="fake-model", prompt="hello", max_tokens=3)
    text = http.get("/metrics").text
    for name in ("tessera:num_requests_running", "tessera:kv_cache_usage_perc",
                 "tessera:generation_tokens_total", "tessera:prefix_cache_queries_total"):
        assert any(line.startswith(name + '{model_name="fake-model"} ')
                   for line in text.splitlines()), name
    assert "# TYPE tessera:num_requests_running gauge" in text
    assert "# TYPE tessera:generation_tokens_total counter" in text
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds"):
        assert f"tessera:{hist}_count" in text
    assert _metric(http, "tessera:e2e_request_latency_seconds_count") >= 1


def test_engine_failure_is_reported_and_survived(http):
    r = http.post("/v1/completions", json={"prompt": "__boom__", "max_tokens": 3})
    assert r.status_code == 500 and "engine step failed" in r.json()["error"]["message"]
    assert "boom" not in r.json()["error"]["message"]  # internal text stays in the log
    r = http.post("/v1/completions", json={"prompt": "after", "max_tokens": 3,
                                           "stream": True})
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["choices"]
