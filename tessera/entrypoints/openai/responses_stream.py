"""The Responses API's streaming events, made from the chat path's stream of chunks.

A chat chunk carries deltas of content, tool calls (and, with a reasoning parser, reasoning);
`ResponseEvents` turns them into OpenAI's typed events, each with its `sequence_number`:

    response.created, response.in_progress
    per output item, in order:
        response.output_item.added
        message:        response.content_part.added, response.output_text.delta ...,
                        response.output_text.done, response.content_part.done
        function_call:  response.function_call_arguments.delta ...,
                        response.function_call_arguments.done
        reasoning:      response.reasoning_text.delta ..., response.reasoning_text.done
        response.output_item.done
    response.completed (its `status` is "incomplete" when max_output_tokens cut the answer)

An item ends when the next begins or the stream ends. An error after the first event is an
`error` event, and the stream ends there.
"""

from __future__ import annotations

import json
from typing import Any

from tessera.entrypoints.openai.responses_items import (
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
)


class ResponseEvents:
    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []  # output items, finished or open (the last)
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, type: str, **fields: Any) -> str:
        data = {"type": type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        """The events for one chat chunk."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return out

    def open_message(self) -> list[str]:
        """Start a message item (closing the open item)."""
        out = self.close()
        item = message_item("", "in_progress")
        out += self._add(item)
        out.append(self.event("response.content_part.added", item_id=item["id"],
                              output_index=len(self.items) - 1, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _text(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            if kind == "message":
                out += self.open_message()
            else:
                out += self.close()
                out += self._add(reasoning_item(""))
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        name = ("response.output_text.delta" if kind == "message"
                else "response.reasoning_text.delta")
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(name, item_id=item["id"], output_index=len(self.items) - 1,
                              content_index=0, delta=text, **extra))
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            out += self.close()
            item = function_call_item(call.get("id") or new_id("call"),
                                      function.get("name") or "", "", "in_progress")
            self.calls[index] = item
            out += self._add(item)
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.items.index(item), delta=arguments))
        return out

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self.open = item
        snapshot = json.loads(json.dumps(item))
        return [self.event("response.output_item.added", output_index=len(self.items) - 1,
                           item=snapshot)]

    def close(self) -> list[str]:
        """Finish the open item (at the next item, or at the end)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        out = []
        item["status"] = "completed"
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out.append(self.event("response.output_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0,
                                  part=item["content"][0]))
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=index, content_index=0,
                                  text=item["content"][0]["text"]))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=item["name"],
                                  arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out
