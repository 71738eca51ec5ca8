"""Translation between the Responses API's items and chat messages, in both directions.

`/v1/responses` runs on the chat path (the chat template, tool calls, structured outputs), so a
conversation of Responses items becomes chat messages, and a chat answer becomes output items:

    message {role, content}            <-> {"role", "content"}          (developer: a system turn)
    function_call {call_id, name, ...} <-> an assistant turn's tool_calls (consecutive calls share
                                           one turn, with the text before them)
    function_call_output {call_id}     <-> {"role": "tool", "tool_call_id", "content"}
    reasoning                          <-  reasoning_content, where a reasoning parser splits it
"""

from __future__ import annotations

import uuid
from typing import Any

from tessera.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as chat messages (without `instructions`)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            _add_call(messages, call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
        # a reasoning item sent back is skipped: templates drop earlier reasoning anyway
    return messages


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A function call belongs to the assistant turn it follows, else to a turn of its own."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def answer_messages(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer as the assistant turn a later request continues from."""
    turn: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    calls = [{"id": c["id"], "type": "function",
              "function": {"name": c["function"]["name"],
                           "arguments": c["function"]["arguments"]}}
             for c in message.get("tool_calls") or []]
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def message_item(text: str, status: str = "completed", item_id: str | None = None
                 ) -> dict[str, Any]:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed",
                       item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as output items: reasoning, then the text, then each call."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content or not calls:
        items.append(message_item(content or ""))
    for call in calls:
        items.append(function_call_item(call["id"], call["function"]["name"],
                                        call["function"]["arguments"]))
    return items


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = chat_usage or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}
