"""`/v1/embeddings` through the `openai` client against a real uvicorn serving the real engine: a
tiny random Llama over the default model's vocabulary (with its tokenizer), `--pooler-config`
MEAN. Vectors equal HF transformers' final hidden states averaged (1e-5), for strings and token
ids, one and many, in float and base64."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from tiny_llama import save_tiny_llama_with_tokenizer

from tessera.config import EngineArgs
from tessera.engine.async_engine import AsyncLLMEngine
from tessera.entrypoints.cli import build_parser, engine_args_from
from tessera.entrypoints.openai.server import build_app
from tessera.model.default_model import default_model_path

from .conftest import UvicornThread

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-embed"))
    model = save_tiny_llama_with_tokenizer(path, default_model_path())
    return path, model


@pytest.fixture(scope="module")
def server(tiny):
    args = engine_args_from(build_parser().parse_args([
        "serve", "--model", tiny[0], "--max-model-len", "128",
        "--pooler-config", '{"pooling_type": "MEAN", "normalize": true}']))
    engine = AsyncLLMEngine.from_engine_args(args)
    with UvicornThread(build_app(engine, served_model_name=MODEL)) as srv:
        yield srv


def test_pooler_config_flag_is_checked():
    with pytest.raises(ValueError, match="--pooler-config is not valid JSON"):
        EngineArgs(pooler_config="{MEAN}").create_engine_config()
    config = EngineArgs(pooler_config='{"pooling_type": "cls", "normalize": false}')
    pooler = config.create_engine_config().pooler
    assert (pooler.pooling_type, pooler.normalize) == ("CLS", False)
    assert EngineArgs().create_engine_config().pooler.pooling_type == "LAST"  # vLLM's default


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def hf_mean(model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model.model(torch.tensor([token_ids])).last_hidden_state[0]
    return F.normalize(hidden.mean(dim=0), dim=-1)


def tokenize(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_token_ids_match_hf(client, tiny):
    _, model = tiny
    prompts = [[5, 99, 1000, 7], list(range(300, 360)), [42] * 9]
    one = client.embeddings.create(model=MODEL, input=prompts[1], encoding_format="float")
    assert one.object == "list" and len(one.data) == 1 and one.data[0].index == 0
    assert one.usage.prompt_tokens == one.usage.total_tokens == 60
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), hf_mean(model, prompts[1]),
                               atol=1e-5, rtol=0)
    many = client.embeddings.create(model=MODEL, input=prompts, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    assert many.usage.prompt_tokens == sum(len(p) for p in prompts)
    for prompt, d in zip(prompts, many.data, strict=True):
        torch.testing.assert_close(torch.tensor(d.embedding), hf_mean(model, prompt),
                                   atol=1e-5, rtol=0)


def test_strings_base64_and_float(client, server, tiny):
    _, model = tiny
    texts = ["The quick brown fox", "jumps over the lazy dog, twice."]
    # the client asks for base64 by default and decodes it into floats
    default = client.embeddings.create(model=client.models.list().data[0].id, input=texts)
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    raw = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    assert isinstance(raw.data[0].embedding, str)
    for text, a, b in zip(texts, default.data, floats.data, strict=True):
        assert a.embedding == b.embedding  # float32 both ways: bit-equal
        torch.testing.assert_close(torch.tensor(b.embedding),
                                   hf_mean(model, tokenize(server, text)), atol=1e-5, rtol=0)
    assert floats.usage.prompt_tokens == sum(len(tokenize(server, t)) for t in texts)
    single = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    assert single.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-5)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "truncate": True}, "truncate"),
    ({"input": list(range(200))}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, 2], [3, 2**40]]}, "input"),
    ({"input": "hi", "model": "other"}, "model"),
])
def test_refusals_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert param.split(".")[0] in error["message"] or error["param"] == param


def test_dimensions_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="hello", dimensions=16)
    assert "dimensions" in json.dumps(e.value.body)


def test_generation_still_works_beside_embeddings(client, server):
    """Embeddings and completions share the engine; the engine is left idle after both."""
    out = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
    client.embeddings.create(model=MODEL, input=[[1, 2, 3]] * 5, encoding_format="float")
    metrics = httpx.get(server.url + "/metrics").text
    assert "tessera:num_requests_running" in metrics
    running = [line for line in metrics.splitlines()
               if line.startswith("tessera:num_requests_running")]
    assert running and float(running[0].split()[-1]) == 0.0
