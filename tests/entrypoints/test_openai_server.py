"""Acceptance: the real `tessera serve` (default model, free loopback port) driven by the official
`openai` client. One server for the module; max_tokens stays small so the module runs in ~a
minute."""

from __future__ import annotations

import asyncio
import re
import signal
import statistics
import threading
import time

import httpx
import openai
import pytest

from .conftest import ServerProcess
from .test_server import open_request

API_KEY = "sk-tessera-test"
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def metrics(server) -> dict[str, float]:
    values = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tessera:"):
            name, value = line.rsplit(" ", 1)
            # every series carries model_name; key the ones with no other label by bare name
            name = re.sub(r'\{model_name="[^"]*"\}$', "", name)
            values[name] = float(value)
    return values


def test_completion_stream_equals_greedy_and_usage(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert text and full.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    # usage: echo + logprobs lists every prompt and output token once
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                       echo=True, logprobs=0)
    choice = echoed.choices[0]
    assert choice.text == PROMPT + text
    assert (
        len(choice.logprobs.tokens) == echoed.usage.prompt_tokens + echoed.usage.completion_tokens
    )
    assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has none
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    assert echoed.usage.completion_tokens == full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_token_id_prompts_and_indexes(client, model):
    r = client.completions.create(model=model, prompt=[[504, 3458, 314], [504, 3458]], n=2,
                                  max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5
    assert r.choices[0].text == r.choices[1].text  # greedy: both sequences agree


def test_chat_and_stream(client, model):
    messages = [{"role": "user", "content": "Name a fruit."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                          temperature=0)
    content = full.choices[0].message.content
    assert content and full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        full.choices[0].finish_reason
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert full.usage.completion_tokens <= 10


def test_seeded_n2_is_reproducible(client, model):
    def run():
        return client.completions.create(
            model=model,
            prompt=PROMPT,
            n=2,
            max_tokens=8,
            temperature=1.0,
            seed=1234,
            extra_body={"ignore_eos": True},
        )

    first, second = run(), run()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text  # two different samples
    assert first.usage.completion_tokens == 16


def test_stop(client, model):
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                     temperature=0).choices[0].text
    stop = text.strip().split()[1]  # a word from the middle
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                  stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("stop", [["6, 7"], [" 7"], ["5, 6, 7, 8"], [",", " 9"], ["zzz"]])
def test_streamed_text_equals_whole_text_with_stop_strings(client, model, stop):
    """A stream used to leak the start of a multi-token stop string."""
    args = dict(model=model, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=stop)
    whole = client.completions.create(**args).choices[0]
    pieces = [c.choices[0].text for c in client.completions.create(**args, stream=True)
              if c.choices]
    assert "".join(pieces) == whole.text
    if stop == ["6, 7"]:
        assert whole.text == " 5, " and whole.finish_reason == "stop"


def test_logprobs(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the best
    chat = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_32_concurrent_streams_and_health_latency(server, model):
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=10) as http:
            while not stop.is_set():
                start = time.perf_counter()
                assert http.get(server.url + "/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

    async def one(aclient: openai.AsyncOpenAI, i: int) -> str:
        text = ""
        stream = await aclient.completions.create(model=model, prompt=f"{i} + {i} =",
                                                  max_tokens=8, temperature=0, stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
        return text

    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                     max_retries=0, timeout=300)
        return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        texts = asyncio.run(main())
    finally:
        stop.set()
        prober.join()
    assert len(texts) == 32 and all(texts)
    latencies.sort()
    p50, p95 = statistics.median(latencies), latencies[int(0.95 * (len(latencies) - 1))]
    print(f"/health under 32 streams: n={len(latencies)} p50={p50 * 1e3:.1f}ms "
          f"p95={p95 * 1e3:.1f}ms max={latencies[-1] * 1e3:.1f}ms")
    assert p95 < 0.1


def _wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_everything(server):
    _wait_for(lambda: metrics(server)["tessera:num_requests_running"] == 0)
    idle = metrics(server)
    sock = open_request(server.url, "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True,
                         "stream": True}, API_KEY)
    received = b""
    while received.count(b"data: ") < 2:  # a couple of tokens are out
        chunk = sock.recv(4096)
        assert chunk
        received += chunk
    busy = metrics(server)
    assert busy["tessera:num_requests_running"] == 1
    assert busy["tessera:kv_cache_usage_perc"] > idle["tessera:kv_cache_usage_perc"]
    sock.close()
    after = _wait_for(lambda: (m := metrics(server))["tessera:num_requests_running"] == 0
                      and m["tessera:kv_cache_usage_perc"] == idle["tessera:kv_cache_usage_perc"]
                      and m)
    generated = after["tessera:generation_tokens_total"] - idle["tessera:generation_tokens_total"]
    assert generated < 500  # aborted, not run to completion


@pytest.mark.parametrize("body, status, fragments", [
    ('{"prompt": ', 400, ["malformed JSON"]),
    ({"prompt": "hi", "max_tokens": "7"}, 400, ["max_tokens"]),
    ({"prompt": "hi", "temperature": 9}, 400, ["temperature"]),
    ({"prompt": "hi", "bad_words": ["x"]}, 400, ["unsupported parameter", "bad_words"]),
    ({"prompt": "hi", "logit_bias": {"1": 101}}, 400, ["logit_bias"]),
    # max_model_len: the default model's own limit, 8192
    ({"prompt": "hello " * 8300}, 400, ["8192", "in the prompt"]),
    ({"prompt": "hi", "max_tokens": 9000}, 400, ["8192", "9000"]),
    ({"prompt": [70000]}, 400, ["70000", "vocabulary"]),
    ({"prompt": "hi", "model": "gpt-4"}, 404, ["gpt-4"]),
])
def test_bad_inputs(server, body, status, fragments):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if isinstance(body, str):
        r = httpx.post(server.url + "/v1/completions", content=body, timeout=30,
                       headers={**headers, "Content-Type": "application/json"})
    else:
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("extra", [
    {"repetition_penalty": 5e-324}, {"repetition_penalty": 10}, {"top_p": 5e-324},
    {"top_k": 1}, {"min_p": 1.0}, {"temperature": 2.0}, {"temperature": 1e-9},
    {"presence_penalty": -2, "frequency_penalty": 2}, {"seed": 2**64 - 1}, {"seed": -(2**63)},
    {"n": 3, "min_tokens": 2}, {"logprobs": 20},
])
def test_extreme_sampling_values_never_500(server, extra):
    """Boundary values of every sampling field (what schemathesis' coverage phase sends)."""
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 1.0, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text


def test_wrong_key_is_401(server, model):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt="hi", max_tokens=1)
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_sigterm_aborts_and_exits_zero(server, client, model):
    """Last: stops the module's server."""
    sock = open_request(server.url, "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True,
                         "stream": True}, API_KEY)
    received = b""
    while b"data: " not in received:
        received += sock.recv(4096)
    start = time.monotonic()
    assert server.stop(signal.SIGTERM, timeout=30) == 0
    assert time.monotonic() - start < 15
    sock.settimeout(5)
    while chunk := sock.recv(65536):
        received += chunk
    assert b"data: [DONE]" in received
    sock.close()
