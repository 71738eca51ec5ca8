"""A model without a tokenizer (a bare HF checkpoint) over HTTP: token ids in, token ids out. Every
field that needs text is a 400 naming it, refused before the request reaches the engine; against
the fake engine, and against a tiny random Llama checkpoint served by the real engine."""

from __future__ import annotations

import httpx
import pytest

from tessera.engine.async_engine import AsyncLLMEngine
from tessera.entrypoints.openai.server import build_app

from .conftest import UvicornThread, serve_fake

# (endpoint, body, param, fragment of the message)
REFUSED = [
    ("/v1/completions", {"prompt": "hello"}, "prompt", "prompt is text"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "prompt is text"),
    ("/v1/completions", {"prompt": [1, 2, 3], "echo": True}, "echo", "echo requires a tokenizer"),
    ("/v1/completions", {"prompt": [1, 2, 3], "logprobs": 0}, "logprobs",
     "logprobs requires a tokenizer"),
    ("/v1/completions", {"prompt": [1, 2, 3], "stop": ["x"]}, "stop", "stop requires a tokenizer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages",
     "no tokenizer, so no chat template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 2}, "messages", "no chat template"),
]


def _check_refused(url: str, endpoint: str, body: dict, param: str, fragment: str) -> None:
    r = httpx.post(url + endpoint, json={"max_tokens": 3, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"] and "tokenizer" in err["message"]


@pytest.fixture(scope="module")
def fake_server():
    srv, engine = serve_fake(tokenizer=False)
    with srv:
        srv.engine = engine
        yield srv


@pytest.mark.parametrize("endpoint, body, param, fragment", REFUSED)
def test_fields_that_need_text_are_refused(fake_server, endpoint, body, param, fragment):
    steps = fake_server.engine.num_steps
    _check_refused(fake_server.url, endpoint, body, param, fragment)
    assert fake_server.engine.num_steps == steps and not fake_server.engine.requests


@pytest.mark.parametrize("stream", [False, True])
def test_token_id_prompts_still_work(fake_server, stream):
    r = httpx.post(fake_server.url + "/v1/completions", timeout=30, json={
        "prompt": [[104, 105], [104]], "max_tokens": 3, "temperature": 0, "stream": stream,
        "stream_options": {"include_usage": True} if stream else None})
    assert r.status_code == 200, r.text
    if not stream:
        body = r.json()
        assert [c["text"] for c in body["choices"]] == ["", ""]  # no tokenizer, no text
        assert body["usage"]["completion_tokens"] == 6
    else:
        assert r.text.rstrip().endswith("data: [DONE]") and '"completion_tokens": 6' in r.text


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """The real engine over a tiny random Llama checkpoint saved without a tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tessera.config import EngineArgs
    from tessera.engine.llm_engine import LLMEngine

    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path), max_model_len=256,
                                                   max_num_batched_tokens=256,
                                                   num_gpu_blocks_override=64))
    assert engine.tokenizer is None
    with UvicornThread(build_app(AsyncLLMEngine(engine))) as srv:
        yield srv


def test_real_engine_without_tokenizer(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/completions", timeout=60,
                   json={"prompt": [1, 5, 9, 33], "max_tokens": 4, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    for endpoint, body, param, fragment in REFUSED:
        _check_refused(tiny_server.url, endpoint, body, param, fragment)
