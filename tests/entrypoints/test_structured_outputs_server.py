"""Structured outputs, tools and the rest of the request surface against the real `tessera serve`,
driven by the `openai` client: outputs validate against their schemas (`jsonschema`), streaming
and not, n > 1, concurrently with unconstrained requests whose greedy text must not change."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from .conftest import ServerProcess

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 18, "maximum": 99}},
            "required": ["name", "age"]}},
        "required": ["user"]},
    "array_enum": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 3}},
        "required": ["colors"]},
    "optional_pattern": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{3}$"},
        "note": {"type": "string", "maxLength": 10},
        "ok": {"type": "boolean"}},
        "required": ["id", "ok"]},
    "number_range": {"type": "object", "properties": {
        "price": {"type": "number", "minimum": 0.5, "maximum": 9.5},
        "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["price", "qty"]},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def chat(client, model, content, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], **kw)


def schema_format(name):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def test_schemas_streaming_and_not_with_n_beside_unconstrained(client, model):
    def free():
        return client.completions.create(model=model, prompt="The capital of France is",
                                         max_tokens=12, temperature=0).choices[0].text

    alone = free()

    def constrained(name):
        r = chat(client, model, f"Give an example {name.replace('_', ' ')} record as JSON.",
                 response_format=schema_format(name), max_tokens=80, n=2, temperature=0.7,
                 seed=3)
        return name, [c.message.content for c in r.choices]

    def streamed(name):
        stream = chat(client, model, f"A {name.replace('_', ' ')} record as JSON.",
                      response_format=schema_format(name), max_tokens=80, temperature=0,
                      stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return name, [text]

    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(constrained, n) for n in SCHEMAS]
        jobs += [pool.submit(streamed, n) for n in SCHEMAS]
        frees = [pool.submit(free) for _ in range(2)]
        results = [j.result() for j in jobs]
        assert [f.result() for f in frees] == [alone, alone]
    for name, outputs in results:
        for text in outputs:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert sum(len(o) for _, o in results) == 3 * len(SCHEMAS)


def test_regex_choice_grammar_and_json_object(client, model):
    r = client.completions.create(model=model, prompt="A ticket code:", max_tokens=20,
                                  temperature=0, extra_body={
                                      "structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{4}"}})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", r.choices[0].text)
    r = chat(client, model, "Is water wet?", max_tokens=5, temperature=0,
             extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    gbnf = 'root ::= "The answer is " digit "."\ndigit ::= [0-9]'
    r = client.completions.create(model=model, prompt="What is 2+2?", max_tokens=10,
                                  temperature=0, extra_body={"guided_grammar": gbnf})
    assert re.fullmatch(r"The answer is [0-9]\.", r.choices[0].text)
    r = chat(client, model, "Return a JSON object with keys name and age for Bob, 30.",
             response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_choice_required_and_named(client, model):
    r = chat(client, model, "What is the weather in Paris?", tools=[WEATHER, TIME],
             tool_choice="required", max_tokens=100, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert call.id and call.type == "function"
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, model, "Weather in Rome?", tools=[WEATHER, TIME], tool_choice=named,
             max_tokens=60, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # streaming: the name first, then argument pieces that concatenate to the same arguments
    stream = chat(client, model, "Weather in Rome?", tools=[WEATHER, TIME], tool_choice=named,
                  max_tokens=60, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].tool_calls[0].function.name == "get_weather" and deltas[0].tool_calls[0].id
    args = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)
    assert args == call.function.arguments
    # a follow-up turn carrying the call and the tool's answer renders and runs
    r = client.chat.completions.create(model=model, max_tokens=8, messages=[
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, sunny"}])
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
])
def test_invalid_constraints_are_400_naming_the_field(server, model, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert ".cc:" not in error["message"]


def test_fields_without_effect_are_accepted_and_suffix_is_refused(server, model):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "store": False, "metadata": {"k": "v"}, "user": "u1", "service_tier": "auto",
        "parallel_tool_calls": True, "reasoning_effort": "low"})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "def f(", "suffix": "return x", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_include_stop_str_and_truncation(client, model):
    base = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=6,
                                     temperature=0)
    text = base.choices[0].text
    r = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0,
                                  stop=[text.split()[1]],
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text.endswith(text.split()[1])
    r = client.completions.create(model=model, prompt="word " * 50, max_tokens=1, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5


def test_tokenize_and_detokenize(server, model):
    r = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > 0
    r = httpx.post(server.url + "/detokenize", json={"model": model, "tokens": body["tokens"]})
    assert r.json()["prompt"] == "Hello world"
    r = httpx.post(server.url + "/tokenize", json={
        "messages": [{"role": "user", "content": "Hello"}], "return_token_strs": True})
    chat_body = r.json()
    assert chat_body["count"] > body["count"] and len(chat_body["token_strs"]) == chat_body["count"]
    r = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
