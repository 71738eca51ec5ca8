"""The reliability suite: a real `tessera serve` (default model) on 127.0.0.1, treated as a hostile
user would treat it. Rule: one request's input never fails, slows or starves another.

- bad-input barrage: hypothesis draws request parameters over the full JSON range (huge
  integers, NaN/inf, extreme floats, wrong types) and sends each beside 4 ordinary greedy
  streaming requests; the ordinary ones must complete with their expected tokens, the bad one
  must get a 4xx or complete normally;
- an oversized body (413) and a huge prompt under the limit (400) beside /health probes;
- disconnects mid-stream: the KV cache goes back to 0;
- a busy port fails in seconds (before the model loads);
- SIGTERM with requests in flight: the streams end, the server exits 0;
- (heavy) a tiny cache under each preemption mode gives the ample cache's tokens, over HTTP.

What it sends and what comes back: docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from entrypoints.conftest import ServerProcess, free_port, probe_health_while
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

VICTIMS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
VICTIM_TOKENS = 8
MAX_MODEL_LEN = 256
SERVER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
               "--kv-cache-space", "0.25")


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(*SERVER_ARGS)
    try:
        yield srv
    finally:
        srv.stop()


def _victim_body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": VICTIM_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}


async def _stream_text(client: httpx.AsyncClient, body: dict) -> tuple[int, str, bool]:
    """(status, concatenated text, whether the stream ended with [DONE] and no error event)."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, "", False
        text, clean, done = [], True, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                clean = False
                continue
            text += [c["text"] for c in event["choices"]]
        return 200, "".join(text), clean and done


@pytest.fixture(scope="module")
def expected(server) -> list[str]:
    """Each victim alone: the tokens it must get whatever runs beside it."""
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            outs = [await _stream_text(c, _victim_body(p)) for p in VICTIMS]
        assert all(status == 200 and ok and text for status, text, ok in outs), outs
        return [text for _, text, _ in outs]

    return asyncio.run(run())


# -- the barrage -------------------------------------------------------------------------------

_HUGE_INTS = st.sampled_from([2**63, 2**64, 2**64 - 1, -(2**63) - 1, 2**70, 10**30,
                              1180591620717411303424, -(10**30)])
_EXTREME_FLOATS = st.sampled_from([1e308, -1e308, 5e-324, -5e-324, 1.7976931348623157e308,
                                   math.nan, math.inf, -math.inf, 1e-300])
_ANY = st.one_of(
    _HUGE_INTS, _EXTREME_FLOATS, st.integers(-3, 300), st.floats(allow_nan=True),
    st.booleans(), st.none(), st.text(max_size=8), st.lists(st.integers(-2, 2**40), max_size=3),
    st.just("x" * 5000), st.lists(st.text(min_size=1, max_size=4), max_size=40),
)
_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "stop", "max_tokens", "min_tokens",
           "logprobs", "priority", "ignore_eos", "echo", "stream", "user", "stop_token_ids"]
_CHAT_FIELDS = [f for f in _FIELDS if f not in ("logprobs", "echo")] + [
    "top_logprobs", "logprobs", "max_completion_tokens"]


@st.composite
def bad_requests(draw) -> tuple[str, dict]:
    chat = draw(st.booleans())
    fields = _CHAT_FIELDS if chat else _FIELDS
    body: dict = {f: draw(_ANY) for f in draw(st.sets(st.sampled_from(fields), min_size=1,
                                                      max_size=4))}
    body.setdefault("max_tokens", draw(st.integers(1, 6)))  # bound the work when accepted
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.sampled_from(["hi", "\ud800",
                                                                               "x" * 3000]))}]
        return "/v1/chat/completions", body
    body["prompt"] = draw(st.one_of(st.just("hi"), st.lists(st.just("a"), min_size=1,
                                                            max_size=70),
                                    st.lists(st.integers(-1, 2**64), min_size=1, max_size=3)))
    return "/v1/completions", body


async def _send_bad(client: httpx.AsyncClient, path: str, body: dict) -> None:
    content = json.dumps(body, allow_nan=True)  # NaN/Infinity literals: what a sloppy client sends
    headers = {"content-type": "application/json"}
    if body.get("stream") is True:
        async with client.stream("POST", path, content=content, headers=headers) as r:
            raw = (await r.aread()).decode("utf-8", "replace")
            if r.status_code == 200:
                assert raw.rstrip().endswith("data: [DONE]"), raw[-300:]
                assert '"error"' not in raw, raw[-300:]  # completes normally
                return
    else:
        r = await client.post(path, content=content, headers=headers)
        raw = r.text
        if r.status_code == 200:
            assert "choices" in r.json()
            return
    assert 400 <= r.status_code < 500, f"{body!r} -> {r.status_code} {raw[:300]}"
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] is None or isinstance(error["code"], str)
    assert "Traceback" not in error["message"] and "Overflow" not in error["message"]


def _barrage(server, expected, case) -> None:
    path, body = case

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            victims = [asyncio.create_task(_stream_text(c, _victim_body(p))) for p in VICTIMS]
            await asyncio.sleep(0.05)  # the victims are in flight when the bad one arrives
            await _send_bad(c, path, body)
            outs = await asyncio.gather(*victims)
        for (status, text, clean), want in zip(outs, expected, strict=True):
            assert status == 200 and clean, (body, status)
            assert text == want, (body, text, want)

    asyncio.run(run())


@given(case=bad_requests())
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])
def test_bad_input_barrage_beside_victims(server, expected, case):
    _barrage(server, expected, case)


@pytest.mark.heavy
@given(case=bad_requests())
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.generate])
def test_bad_input_barrage_beside_victims_long(server, expected, case):
    _barrage(server, expected, case)


@pytest.mark.parametrize("case", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "top_k": 1180591620717411303424,
                         "top_p": 0.9, "temperature": 1.0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "top_k": 2**63, "min_p": 0.1,
                         "temperature": 1.0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "top_k": 2**63, "temperature": 1.0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "seed": 18446744073709551615,
                         "temperature": 0.8, "n": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "seed": 18446744073709551615,
                         "temperature": 0.8, "n": 2, "stream": True}),
])
def test_huge_top_k_and_seed_requests_beside_victims(server, expected, case):
    """The inputs that once failed every request in flight."""
    _barrage(server, expected, case)


# -- bounded work before admission -------------------------------------------------------------

def _post_raw(url: str, body: bytes) -> int:
    """POST `body` over a plain socket and return the status. A server that refuses a body by
    its Content-Length answers and closes while the client is still sending: an HTTP client
    that writes the whole body before reading then sees a broken pipe instead of the 413."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n")
        try:
            for i in range(0, len(body), 1 << 16):
                sock.sendall(body[i:i + (1 << 16)])
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused early: the answer is already waiting
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ", 2)[1])


@pytest.mark.parametrize("size, status", [(50 * 2**20, 413), (5 * 2**20, 413), (3 * 2**20, 400)])
def test_oversized_body_beside_health_probes(server, size, status):
    body = json.dumps({"prompt": "w" * size, "max_tokens": 4}).encode()
    t0 = time.perf_counter()
    latencies, got = probe_health_while(server.url, lambda: _post_raw(server.url, body))
    elapsed = time.perf_counter() - t0
    assert got == status
    print(f"{size} B -> {status} in {elapsed:.2f} s; /health max {max(latencies) * 1e3:.0f} ms "
          f"over {len(latencies)} probes")
    assert max(latencies) < 0.25, f"/health took up to {max(latencies) * 1e3:.0f} ms"
    assert elapsed < 10


def test_prompt_plus_max_tokens_over_the_context_is_a_400_naming_max_tokens(server):
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": "word " * 200, "max_tokens": 100, "stream": stream})
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["param"] == "max_tokens"


# -- disconnects, ports, shutdown ----------------------------------------------------------------

def _metric(url: str, name: str) -> float:
    """An unlabelled series' value (every series carries `{model_name="..."}`)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def test_disconnects_mid_stream_free_the_kv(server):
    host, port = server.url.removeprefix("http://").split(":")
    socks = []
    for i in range(6):
        body = json.dumps({"prompt": f"Count to a hundred: {i}", "max_tokens": 200,
                           "stream": True, "ignore_eos": True}).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.recv(4096)  # headers and the first events: it is running
        socks.append(s)
    assert _metric(server.url, "tessera:kv_cache_usage_perc") > 0
    for s in socks:
        s.close()
    deadline = time.monotonic() + 10
    while _metric(server.url, "tessera:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "KV not freed after the clients left"
        time.sleep(0.05)
    assert _metric(server.url, "tessera:num_requests_running") == 0


def test_busy_port_fails_fast():
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "tessera.entrypoints.cli", "serve", "--port",
                               str(port)], capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - t0
    assert proc.returncode == 1 and "cannot listen" in proc.stderr, proc.stderr[-2000:]
    assert "Address already in use" in proc.stderr
    assert elapsed < 30  # the model (seconds to load) was never touched


def test_sigterm_with_requests_in_flight(server, expected):
    """Last in the module: it stops the module's server."""
    async def run() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            body = {"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            streams = [asyncio.create_task(_stream_text(c, body)) for _ in range(4)]
            plain = asyncio.create_task(c.post("/v1/completions", json={
                "prompt": "Another long story.", "max_tokens": 200, "ignore_eos": True}))
            await asyncio.sleep(1.5)  # running
            t0 = time.monotonic()
            code = await asyncio.to_thread(server.stop, signal.SIGTERM, 30)
            elapsed = time.monotonic() - t0
            outs = await asyncio.gather(*streams, plain, return_exceptions=True)
            return [code, elapsed, outs]

    code, elapsed, outs = asyncio.run(run())
    assert code == 0 and elapsed < 15, (code, elapsed)
    *streams, plain = outs
    for out in streams:  # every stream ended (cut short), none hung
        assert isinstance(out, tuple | httpx.HTTPError), out
    assert isinstance(plain, httpx.Response | httpx.HTTPError)
    if isinstance(plain, httpx.Response):
        assert plain.status_code in (200, 503)


# -- tiny caches (heavy: three servers) ----------------------------------------------------------

@pytest.mark.heavy
def test_tiny_cache_under_each_preemption_mode_matches_an_ample_cache():
    prompts = [f"Write a short poem about the number {i}." for i in range(8)]

    def run(*args: str) -> tuple[list[str], float]:
        srv = ServerProcess("--max-model-len", "256", *args)
        try:
            async def go() -> list[str]:
                async with httpx.AsyncClient(base_url=srv.url, timeout=300) as c:
                    rs = await asyncio.gather(*[c.post("/v1/completions", json={
                        "prompt": p, "max_tokens": 64, "temperature": 0, "ignore_eos": True})
                        for p in prompts])
                assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
                return [r.json()["choices"][0]["text"] for r in rs]

            texts = asyncio.run(go())
            return texts, _metric(srv.url, "tessera:num_preemptions_total")
        finally:
            assert srv.stop() == 0

    ample, _ = run()
    for mode in ("swap", "recompute"):
        # 16 blocks of 16: one 256-token request fits, eight do not
        tiny, preemptions = run("--num-gpu-blocks-override", "16", "--preemption-mode", mode)
        assert preemptions > 0, mode
        assert tiny == ample, mode
