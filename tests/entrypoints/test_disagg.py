"""Disaggregated prefill/decode end to end: a prefill server and a decode server (separate
processes on loopback, `--kv-transfer-config`), the proxy in front of them, against a colocated
engine on the same weights in fp32 (greedy). The decode side's counters show it computed one
prompt token per transferred request (the last, recomputed to sample), and both sides' block
usage returns to 0. The fault scenarios (heavy) kill, freeze and misdirect the peers: every
request ends in a complete answer (the decode side prefills locally) or a clean error, and
nothing hangs."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tessera.entrypoints.proxy import DisaggProxy, build_app
from tessera.sampling.params import SamplingParams

from .conftest import ServerProcess, UvicornThread, free_port

PRODUCER = '{"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": %d%s}'
CONSUMER = '{"kv_connector": "TcpConnector", "kv_role": "kv_consumer"%s}'
# --quantization gguf: the colocated reference (make_llm) runs the exact products
COMMON = ("--max-model-len", "1024", "--kv-cache-space", "0.25", "--swap-space", "0.05",
          "--quantization", "gguf")


def _extra(**values) -> str:
    return (', "kv_connector_extra_config": ' + json.dumps(values)) if values else ""


def start_pair(prefill_args=(), decode_args=(), producer_extra=None, consumer_extra=None):
    """A prefill and a decode server, started side by side (they load the model at once)."""
    kv_port = free_port()
    p_args = (*COMMON, *prefill_args, "--kv-transfer-config",
              PRODUCER % (kv_port, _extra(**(producer_extra or {}))))
    d_args = (*COMMON, *decode_args, "--kv-transfer-config",
              CONSUMER % _extra(**(consumer_extra or {})))
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ServerProcess, *p_args), pool.submit(ServerProcess, *d_args)]
        servers = []
        errors = []
        for f in futures:
            try:
                servers.append(f.result())
            except Exception as e:  # the other may be up: stop it too
                errors.append(e)
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    return servers


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tessera:") and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def wait_usage_zero(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (usage := metrics(url)["tessera:kv_cache_usage_perc"]) > 0:
        assert time.monotonic() < deadline, f"{url} still holds blocks ({usage:.3f})"
        time.sleep(0.2)


def complete(url: str, prompt, max_tokens: int = 12, **kw) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def reference(llm, prompts, max_tokens: int = 12) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                        use_tqdm=False)
    return [o.outputs[0].text for o in outs]


BOTH = '{"kv_connector": "TcpConnector", "kv_role": "kv_both", "kv_port": %d}'


@pytest.fixture(scope="module", params=[
    "one kv_both process", pytest.param("two processes", marks=pytest.mark.heavy)])
def pair(request):
    """(prefill, decode). The quick variant is one kv_both server that serves its own pulls over
    loopback TCP (one model load); the heavy one is a producer and a consumer process."""
    if request.param == "two processes":
        servers = start_pair()
    else:
        servers = [ServerProcess(*COMMON, "--kv-transfer-config", BOTH % free_port())]
    yield servers[0], servers[-1]
    for s in servers:
        s.stop()


def test_proxy_greedy_equals_colocated_and_decode_computes_no_prompt(pair, make_llm):
    prefill, decode = pair
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while"]
    prompts = [" ".join(words[: k % 10 + 1] * (k // 10 + 1)) for k in (0, 15, 33, 88)]
    expected = reference(make_llm(), prompts)
    before = metrics(decode.url)
    before_p = metrics(prefill.url)
    with UvicornThread(build_app(DisaggProxy([prefill.url], [decode.url]))) as proxy:
        answers = [complete(proxy.url, p) for p in prompts]
        got = [a["choices"][0]["text"] for a in answers]
        prompt_lens = [a["usage"]["prompt_tokens"] for a in answers]
        # chat, streamed, through the same path
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
                ) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        prompt_lens.append(json.loads(events[-2][6:])["usage"]["prompt_tokens"])
    assert got == expected
    after = metrics(decode.url)
    n = len(prompts) + 1
    one = prefill is decode  # then its counters hold both sides
    transfers = (
        after["tessera:kv_transfer_requests_total"] - before["tessera:kv_transfer_requests_total"]
    )
    assert transfers == (2 * n if one else n)
    assert (
        after["tessera:kv_transfer_failures_total"] == before["tessera:kv_transfer_failures_total"]
    )
    # one prompt token per transferred request (the last, recomputed for its logits)
    prompt_tokens = after["tessera:prompt_tokens_total"] - before["tessera:prompt_tokens_total"]
    if one:  # ... on top of the whole prompts it prefilled as the producer
        assert prompt_tokens == sum(prompt_lens) + n
    else:
        assert prompt_tokens == n
        assert (metrics(prefill.url)["tessera:kv_transfer_requests_total"]
                - before_p["tessera:kv_transfer_requests_total"]) == n
    wait_usage_zero(prefill.url)
    wait_usage_zero(decode.url)


def test_kv_transfer_params_are_refused_where_they_cannot_apply(pair):
    prefill, decode = pair
    r = httpx.post(decode.url + "/v1/completions", timeout=30, json={
        "prompt": "hi there", "max_tokens": 1, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_block_ids": [1, 2, 3]}})
    assert r.status_code == 400 and "remote_block_ids" in r.json()["error"]["message"]
    r = httpx.post(decode.url + "/v1/completions", timeout=30, json={
        "prompt": ["a", "b"], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    if prefill is not decode:  # each role refuses the other's params
        r = httpx.post(decode.url + "/v1/completions", timeout=30, json={
            "prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 400 and "do_remote_decode" in r.json()["error"]["message"]


# -- heavy: many lengths, prefix hits on either side, and the faults ----------------------------

@pytest.mark.heavy
def test_many_lengths_and_prefix_hits_on_either_side_equal_a_colocated_server():
    colocated = ServerProcess(*COMMON)
    servers = []
    try:
        servers = start_pair(("--enable-prefix-caching",), ("--enable-prefix-caching",))
        prefill, decode = servers
        base = "In a village of La Mancha, whose name I do not wish to recall, there lived "
        prompts = [base[: k] for k in (3, 10, 40, 70)] + [base * r for r in (1, 2, 3, 5)]
        # prefix hits: the same long prefix again (producer hits), then a decode-side hit
        prompts += [base * 5 + "a knight", base * 5 + "a squire"]
        with UvicornThread(build_app(DisaggProxy([prefill.url], [decode.url]))) as proxy:
            got = [complete(proxy.url, p, 16)["choices"][0]["text"] for p in prompts]
            # decode-side hit: a prompt the decode server computed locally before
            complete(decode.url, base * 4, 1)
            got.append(complete(proxy.url, base * 4 + "and", 16)["choices"][0]["text"])
        prompts.append(base * 4 + "and")
        expected = [complete(colocated.url, p, 16)["choices"][0]["text"] for p in prompts]
        assert got == expected
        assert metrics(prefill.url)["tessera:prefix_cache_hits_total"] > 0
        assert metrics(decode.url)["tessera:prefix_cache_hits_total"] > 0
        assert metrics(decode.url)["tessera:kv_transfer_failures_total"] == 0
        wait_usage_zero(prefill.url)
        wait_usage_zero(decode.url)
    finally:
        for s in [colocated, *servers]:
            s.stop()


def _params_from(prefill_url: str, prompt: str) -> dict:
    r = httpx.post(prefill_url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


@pytest.mark.heavy
def test_faults_end_in_an_answer_or_a_clean_error_and_free_every_block(make_llm):
    prompt = "Once upon a time, in a land far away, there was a small house by the sea " * 3
    (expected,) = reference(make_llm(), [prompt])
    servers = start_pair(producer_extra={"hold_timeout": 3},
                         consumer_extra={"transfer_timeout": 2})
    prefill, decode = servers
    extra = []
    try:
        # 1. the transport drops: the params point at a port nobody serves; the pull times
        #    out, the decode side prefills locally, and the producer's hold expires
        params = _params_from(prefill.url, prompt)
        params["remote_port"] = free_port()
        t0 = time.monotonic()
        out = complete(decode.url, prompt, kv_transfer_params=params)
        assert out["choices"][0]["text"] == expected and time.monotonic() - t0 < 20
        assert metrics(decode.url)["tessera:kv_transfer_failures_total"] == 1
        wait_usage_zero(decode.url)
        wait_usage_zero(prefill.url)
        assert metrics(prefill.url)["tessera:kv_transfer_failures_total"] == 1  # the expiry

        # 2. a transfer times out: the producer freezes with the blocks held
        params = _params_from(prefill.url, prompt)
        prefill.proc.send_signal(signal.SIGSTOP)
        try:
            out = complete(decode.url, prompt, kv_transfer_params=params)
            assert out["choices"][0]["text"] == expected
        finally:
            prefill.proc.send_signal(signal.SIGCONT)
        wait_usage_zero(decode.url)
        wait_usage_zero(prefill.url)

        # 3. kill the decode engine while it streams a transferred request
        with UvicornThread(build_app(DisaggProxy([prefill.url], [decode.url]))) as proxy:
            with httpx.stream("POST", proxy.url + "/v1/completions", timeout=60, json={
                    "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
                    "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert "choices" in first
                decode.proc.kill()
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
            decode.proc.wait(30)
            wait_usage_zero(prefill.url)  # the peer pulled before it died
            # a dead decode instance: a clean 502, at once
            r = httpx.post(proxy.url + "/v1/completions", timeout=30,
                           json={"prompt": prompt, "max_tokens": 4})
            assert r.status_code == 502 and r.json()["error"]["code"] == "bad_gateway"

        # 4. kill the prefill engine mid-transfer (frozen with the pull waiting, then killed);
        #    then a dead prefill instance: the decode side prefills everything locally
        decode2 = ServerProcess(*COMMON, "--kv-transfer-config",
                                CONSUMER % _extra(transfer_timeout=2))
        extra.append(decode2)
        params = _params_from(prefill.url, prompt)
        prefill.proc.send_signal(signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(complete, decode2.url, prompt, kv_transfer_params=params)
            time.sleep(0.5)
            prefill.proc.kill()
            assert pending.result(timeout=60)["choices"][0]["text"] == expected
        prefill.proc.wait(30)
        with UvicornThread(build_app(DisaggProxy([prefill.url], [decode2.url]))) as proxy:
            assert complete(proxy.url, prompt)["choices"][0]["text"] == expected
        wait_usage_zero(decode2.url)
        assert metrics(decode2.url)["tessera:kv_transfer_failures_total"] == 1
    finally:
        for s in [*servers, *extra]:
            s.stop(signal.SIGKILL if s.proc.poll() is None else signal.SIGTERM)
