"""`/v1/responses` through the `openai` client against a real uvicorn serving the real engine (a
tiny random Llama with the default model's tokenizer and chat template): text equal to the chat
path's greedy answer, streaming and not, function tools (output items, a function_call_output
sent back), `text.format` json_schema, `previous_response_id` from the store (and `store: false`
bypassing it), and the fields we do not honour refused by name."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from tiny_llama import save_tiny_llama_with_tokenizer

from tessera.config import EngineArgs
from tessera.engine.async_engine import AsyncLLMEngine
from tessera.entrypoints.openai.response_store import ResponseStore
from tessera.entrypoints.openai.server import build_app
from tessera.model.default_model import default_model_path

from .conftest import UvicornThread

MODEL = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 8}}, "required": ["city"],
               "additionalProperties": False}, "strict": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-responses"))
    save_tiny_llama_with_tokenizer(path, default_model_path())
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=path, max_model_len=512))
    with UvicornThread(build_app(engine, served_model_name=MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat_answer(client, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                          temperature=0)


def test_text_equals_chat_and_streams_the_same(client):
    r = client.responses.create(model=MODEL, input="Tell me a story.", instructions="Be brief.",
                                max_output_tokens=12, temperature=0)
    chat = chat_answer(client, [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Tell me a story."}], 12)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    expected_status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert r.status == expected_status
    assert r.instructions == "Be brief." and r.max_output_tokens == 12

    events = list(client.responses.create(model=MODEL, input="Tell me a story.",
                                          instructions="Be brief.", max_output_tokens=12,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    for name in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.delta", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done"):
        assert name in types, name
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == r.output_text
    final = events[-1].response
    assert final.output_text == r.output_text and final.status == expected_status
    assert final.usage.output_tokens == r.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == r.output_text


def test_function_tool_call_and_its_output_sent_back(client):
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=60, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls, r.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the caller runs the tool and sends the result back, continuing the stored response
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, max_output_tokens=6, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    # the same conversation through the chat path: the same prompt, the same greedy answer
    chat = chat_answer(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}], 6)
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == chat.choices[0].message.content
    assert follow.previous_response_id == r.id


def test_function_tool_streams_arguments(client):
    events = list(client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[WEATHER], stream=True,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
        temperature=0))
    types = [e.type for e in events]
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert done.arguments == deltas
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.output[0].type == "function_call"
    assert final.response.output[0].arguments == done.arguments


def test_previous_response_id_continues_and_store_false_bypasses(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=5,
                                    temperature=0, instructions="You are a parrot.")
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="What is my name?", max_output_tokens=5,
                                     temperature=0)
    # instructions are not carried over (OpenAI's rule)
    chat = chat_answer(client, [{"role": "user", "content": "My name is Ada."},
                                {"role": "assistant", "content": first.output_text},
                                {"role": "user", "content": "What is my name?"}], 5)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    third = client.responses.create(model=MODEL, previous_response_id=second.id,
                                    input=[{"role": "user", "content": [
                                        {"type": "input_text", "text": "Again?"}]}],
                                    max_output_tokens=3, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens

    unstored = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=unstored.id, input="Hi")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_vllm_sampling_extras_reach_the_chat_path(client):
    messages = [{"role": "user", "content": "Hi"}]
    for kw in ({"temperature": 1.0, "top_k": 50, "seed": 7},  # the same draws with the seed
               {"temperature": 0.0, "logit_bias": {"42": 100}}):  # token 42 every time
        r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                    extra_body=kw)
        chat = client.chat.completions.create(model=MODEL, max_tokens=4, messages=messages,
                                              extra_body=kw)
        assert r.output_text == chat.choices[0].message.content, kw
        assert r.usage.output_tokens == 4


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    r = client.responses.create(
        model=MODEL, input="Pick a color.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"input": []}, "input"),
    ({"input": "hi", "seed": -(2**70)}, "seed"),
])
def test_refusals_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error


def test_store_is_bounded_and_evicts_the_least_recently_used():
    store = ResponseStore(max_entries=2, max_chars=10**6)
    for rid in ("a", "b"):
        store.put(rid, [{"role": "user", "content": rid}], {"id": rid})
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put("c", [], {"id": "c"})
    assert "b" not in store and "a" in store and "c" in store and len(store) == 2
    small = ResponseStore(max_entries=100, max_chars=200)
    for i in range(10):
        small.put(str(i), [{"role": "user", "content": "x" * 50}], {"id": str(i)})
    assert 0 < len(small) < 10 and "9" in small and "0" not in small
    assert small.delete("9") and not small.delete("9")
