"""The Responses API's translation to and from the chat path, without a server: input items to
chat messages, a chat answer to output items, chat chunks to the response.* events (including
the shape a model-format tool parser streams: content, then whole calls)."""

from __future__ import annotations

import json

import pytest

from tessera.entrypoints.openai.protocol_responses import ResponsesRequest
from tessera.entrypoints.openai.responses_items import input_messages, output_items
from tessera.entrypoints.openai.responses_stream import ResponseEvents


def test_items_become_chat_messages():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "be terse"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]})
    assert input_messages(req) == [
        {"role": "developer", "content": "be terse"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function",
             "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]
    assert input_messages(ResponsesRequest.model_validate({"input": "hi"})) == [
        {"role": "user", "content": "hi"}]


def test_answer_becomes_output_items():
    items = output_items({"content": "calling", "reasoning_content": "hmm", "tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[1]["content"][0]["text"] == "calling"
    assert (items[2]["call_id"], items[2]["name"], items[2]["arguments"]) == ("c9", "f", "{}")
    only_call = output_items({"content": None, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{}"}}]})
    assert [i["type"] for i in only_call] == ["function_call"]
    assert [i["type"] for i in output_items({"content": ""})] == ["message"]


def _events(chunks: list[dict]) -> tuple[list[dict], ResponseEvents]:
    events = ResponseEvents()
    raw = []
    for chunk in chunks:
        raw += events.feed(chunk)
    raw += events.close()
    parsed = []
    for text in raw:
        head, data = text.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        parsed.append(event)
    return parsed, events


@pytest.mark.parametrize("whole_calls", [False, True])
def test_chunks_become_events(whole_calls):
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"content": "Let me "}}]},
              {"choices": [{"index": 0, "delta": {"content": "check."}}]}]
    if whole_calls:  # a model-format parser: each call complete, in one delta
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "{\"a\": 1}"}},
            {"index": 1, "id": "c2", "type": "function",
             "function": {"name": "g", "arguments": "{}"}}]}}]})
    else:  # a named function: its arguments stream
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "{\"a\""}}]}}]})
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": ": 1}"}}]}}]})
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}})
    events, state = _events(chunks)
    types = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text_done = next(e for e in events if e["type"] == "response.output_text.done")
    assert text_done["text"] == "Let me check."
    assert types.index("response.output_text.done") < types.index(
        "response.function_call_arguments.delta")
    args_done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert args_done[0]["arguments"] == "{\"a\": 1}" and args_done[0]["name"] == "f"
    assert len(args_done) == (2 if whole_calls else 1)
    item_done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in item_done] == (
        ["message", "function_call", "function_call"] if whole_calls
        else ["message", "function_call"])
    assert all(i["status"] == "completed" for i in item_done)
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == (
        [0, 1, 2] if whole_calls else [0, 1])
    assert state.finish_reason == "tool_calls" and state.usage["completion_tokens"] == 7
