"""Tool calling and reasoning through the official `openai` client against the real `tessera
serve --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser deepseek_r1`.

The model is a tiny random Llama over the default model's vocabulary, with `<think>` and
`</think>` added as tokens (as reasoning models have them), so what it writes is forced: a grammar
(`structured_outputs`) writes a hermes tool call, or `logit_bias` with a frequency penalty writes
one word of thinking and then `</think>`. The chat template opens `<think>` unless
`chat_template_kwargs` says `{"enable_thinking": false}`, as Qwen3's does."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from tiny_llama import save_tiny_llama

from .conftest import ServerProcess

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
    "enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["CET", "UTC"]}}, "required": ["zone"]}}}
CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
         '</tool_call>')
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_path):
    from tessera.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("tiny-reasoning")
    tokenizer = load_tokenizer(default_model_path)
    tokenizer.add_tokens(["<think>", "</think>"])  # plain added tokens: kept in the text
    save_tiny_llama(str(path), num_kv_heads=2, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(str(path))
    (path / "template.jinja").write_text(TEMPLATE)
    return path, tokenizer


@pytest.fixture(scope="module")
def server(tiny):
    path, tokenizer = tiny
    srv = ServerProcess("--model", str(path), "--max-model-len", "512", "--kv-cache-space",
                        "0.05", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "deepseek_r1", "--chat-template",
                        str(path / "template.jinja"))
    try:
        yield srv, tokenizer
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def chat(client, **kw):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0,
        messages=[{"role": "user", "content": "Weather and time in Paris?"}], **kw)


def forced(text: str) -> dict:
    return {"structured_outputs": {"grammar": "root ::= " + json.dumps(text)}, **NO_THINKING}


@pytest.fixture(scope="module")
def whole(client):
    return chat(client, tools=[WEATHER, TIME], max_tokens=120, extra_body=forced(CALLS))


def test_hermes_calls_whole(client, whole):
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                    ("get_time", {"zone": "CET"})]
    assert choice.message.tool_calls[0].id != choice.message.tool_calls[1].id
    assert getattr(choice.message, "reasoning_content", None) is None
    # parallel_tool_calls: false keeps the first call of an "auto" output
    r = chat(client, tools=[WEATHER, TIME], max_tokens=120, parallel_tool_calls=False,
             extra_body=forced(CALLS))
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_hermes_calls_streamed(client, whole):
    chunks = list(chat(client, tools=[WEATHER, TIME], max_tokens=120, stream=True,
                       extra_body=forced(CALLS)))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    assert content.strip() == "Let me check."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    for index, want in enumerate(whole.choices[0].message.tool_calls):
        mine = [tc for tc in calls if tc.index == index]
        assert mine[0].id and mine[0].type == "function"
        assert mine[0].function.name == want.function.name
        assert all(tc.function.name is None and tc.id is None for tc in mine[1:])
        assert len(mine) > 2  # arguments arrive in pieces
        assert "".join(tc.function.arguments or "" for tc in mine) == want.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_required_with_parallel_tool_calls_false_is_one_call(client):
    for stream in (False, True):
        r = chat(client, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60,
                 parallel_tool_calls=False, stream=stream, extra_body=NO_THINKING)
        if stream:
            calls = [tc for c in r if c.choices for tc in c.choices[0].delta.tool_calls or []]
        else:
            calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")


def biased(tokenizer, word: str, **kw) -> dict:
    """logit_bias writing `word` once, then `</think>` (the frequency penalty alternates them)."""
    (w,) = tokenizer.encode(word, add_special_tokens=False)
    (end,) = tokenizer.encode("</think>", add_special_tokens=False)
    return {"logit_bias": {str(w): 10, str(end): 9}, "frequency_penalty": 2.0, **kw}


def test_reasoning_then_structured_output(client, server):
    tokenizer = server[1]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    kw = biased(tokenizer, "Well", max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    r = chat(client, **kw)
    message = r.choices[0].message
    assert message.reasoning_content == "Well"
    assert isinstance(json.loads(message.content)["ok"], bool)  # the grammar after </think>
    assert r.choices[0].finish_reason == "stop"
    chunks = list(chat(client, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Well"
    assert "".join(d.content or "" for d in deltas) == message.content


def test_max_tokens_counts_reasoning(client, server):
    r = chat(client, max_tokens=5, logit_bias={
        str(server[1].encode("Well", add_special_tokens=False)[0]): 10})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.choices[0].message.reasoning_content == "Well" * 5
    assert r.choices[0].message.content is None


def test_chat_template_kwargs_reach_the_template(client):
    r = chat(client, max_tokens=3, extra_body=NO_THINKING)
    assert r.usage.prompt_tokens > chat(client, max_tokens=3).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=3, extra_body={"chat_template_kwargs": {"tools": []}})
    assert e.value.body["param"] == "chat_template_kwargs"
    url = client.base_url.join("/tokenize")
    message = [{"role": "user", "content": "Hi"}]
    counts = [httpx.post(str(url), json={"messages": message, **kw}).json()["count"]
              for kw in ({}, NO_THINKING)]
    assert counts[1] > counts[0]


def test_responses_take_chat_template_kwargs(client):
    def respond(**kw):
        return client.responses.create(model=client.models.list().data[0].id, input="Hi",
                                       max_output_tokens=3, temperature=0, **kw)

    plain, no_thinking = respond(), respond(extra_body=NO_THINKING)
    assert no_thinking.usage.input_tokens > plain.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        respond(extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_llm_chat_takes_chat_template_kwargs(tiny):
    from tessera import LLM, SamplingParams

    llm = LLM(model=str(tiny[0]), max_model_len=128, kv_cache_space=0.05)
    message = [{"role": "user", "content": "Hi"}]
    outs = [llm.chat(message, SamplingParams(max_tokens=1), use_tqdm=False,
                     chat_template=TEMPLATE, chat_template_kwargs=kw)[0]
            for kw in (None, {"enable_thinking": False})]
    assert tiny[1].decode(outs[1].prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    assert tiny[1].decode(outs[0].prompt_token_ids).endswith("assistant\n<think>\n")
