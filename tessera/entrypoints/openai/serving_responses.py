"""`POST /v1/responses` (and `GET`/`DELETE /v1/responses/{id}`): the core of OpenAI's Responses API,
served by the chat path.

A request becomes one chat completion: `instructions` a first system message, the stored
conversation of `previous_response_id` next, then `input` (tessera/entrypoints/openai/
responses_items.py); `max_output_tokens` is max_tokens, `text.format` the response_format, and
`tools` / `tool_choice` / `parallel_tool_calls` go to the chat path's tool calling unchanged (a
named or "required" choice is a grammar; "auto" needs `--enable-auto-tool-choice
--tool-call-parser NAME`). The chat answer becomes output items (message, function_call); a
stream's chat chunks become the response.* events (responses_stream.py). So whatever the chat
path learns (another tool-call parser, a reasoning parser) the Responses API has too.

A finished response is kept in the in-memory `ResponseStore` (LRU, bounded) unless the request
says `store: false`; `previous_response_id` continues a stored one.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from tessera.entrypoints.openai.errors import OpenAIError, bad_request
from tessera.entrypoints.openai.protocol import ChatCompletionRequest
from tessera.entrypoints.openai.protocol_responses import CHAT_EXTRAS, ResponsesRequest
from tessera.entrypoints.openai.response_store import ResponseStore
from tessera.entrypoints.openai.responses_items import (
    answer_messages,
    input_messages,
    new_id,
    output_items,
    usage_of,
)
from tessera.entrypoints.openai.responses_stream import ResponseEvents
from tessera.entrypoints.openai.serving_chat import OpenAIServingChat

# chat-path field names in errors, as a Responses client knows them
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    async def create(self, req: ResponsesRequest, raw_request: Request) -> Response:
        response_id = new_id("resp")
        created = time.time()
        history = self._history(req)
        conversation = history + input_messages(req)
        if not conversation:
            raise bad_request("input is empty: send a message", "input")
        chat_req = self._chat_request(req, conversation)
        try:
            answer = await self.chat.create(chat_req, raw_request)
        except OpenAIError as e:
            raise _renamed(e) from None
        base = self._response(req, response_id, created)
        if req.stream:
            body_iterator = getattr(answer, "body_iterator", None)
            if body_iterator is None:  # refused or aborted before a stream began
                return answer
            # the chat response keeps aborting its engine request when the stream ends
            events = self._events(req, base, conversation, body_iterator)
            answer.body_iterator = events  # type: ignore[attr-defined]
            return answer
        if answer.status_code != 200:
            return answer  # aborted (client gone, or shutdown)
        chat_body = json.loads(bytes(answer.body))
        choice = chat_body["choices"][0]
        response = self._finish(base, output_items(choice["message"]), choice["finish_reason"],
                                chat_body.get("usage"))
        self._keep(req, response, conversation + answer_messages(choice["message"]))
        return JSONResponse(response)

    def retrieve(self, response_id: str) -> Response:
        entry = self.store.get(response_id)
        if entry is None:
            raise OpenAIError(404, f"response {response_id!r} not found (responses are kept in "
                                   "memory, most recently used first, and only with store)",
                              param="response_id", code="response_not_found")
        return JSONResponse(entry.response)

    def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            raise OpenAIError(404, f"response {response_id!r} not found", param="response_id",
                              code="response_not_found")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    # -- building -----------------------------------------------------------------------------

    def _history(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        if req.previous_response_id is None:
            return []
        entry = self.store.get(req.previous_response_id)
        if entry is None:
            raise OpenAIError(400, f"previous response with id {req.previous_response_id!r} not "
                                   "found (it was stored with store: false, evicted from this "
                                   "server's in-memory store, or never existed)",
                              param="previous_response_id", code="previous_response_not_found")
        return [dict(m) for m in entry.messages]

    def _chat_request(self, req: ResponsesRequest, conversation: list[dict[str, Any]]
                      ) -> ChatCompletionRequest:
        messages = ([{"role": "system", "content": req.instructions}]
                    if req.instructions is not None else []) + conversation
        body: dict[str, Any] = {
            "model": req.model, "messages": messages, "stream": bool(req.stream),
            "max_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
            **{name: getattr(req, name) for name in CHAT_EXTRAS},
        }
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        if req.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in req.tools]
        choice = req.tool_choice
        if choice is not None:
            body["tool_choice"] = (choice if isinstance(choice, str)
                                   else {"type": "function", "function": {"name": choice.name}})
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.name is None or fmt.json_schema is None:
                raise bad_request("text.format of type json_schema needs name and schema",
                                  "text.format")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.json_schema, "description": fmt.description,
                "strict": fmt.strict}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            field = str((err.get("loc") or ("messages",))[0])
            param = _PARAMS.get(field, field if field in CHAT_EXTRAS else "input")
            raise bad_request(f"{param}: {err.get('msg', 'invalid value')}", param) from None

    def _response(self, req: ResponsesRequest, response_id: str, created: float
                  ) -> dict[str, Any]:
        """The Response object before its output (what response.created carries)."""
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        text_format: dict[str, Any] = {"type": "text"}
        if fmt is not None:
            text_format = fmt.model_dump(by_alias=True, exclude_none=True)
        choice = req.tool_choice
        return {
            "id": response_id, "object": "response", "created_at": int(created),
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.chat.served_model_name, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "store": req.store is not False, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": text_format},
            "tool_choice": (choice.model_dump() if choice is not None and not isinstance(
                choice, str) else choice or "auto"),
            "tools": [t.model_dump() for t in req.tools or []],
            "truncation": "disabled", "usage": None, "metadata": req.metadata or {},
        }

    @staticmethod
    def _finish(base: dict[str, Any], items: list[dict[str, Any]], finish_reason: str | None,
                chat_usage: dict[str, Any] | None) -> dict[str, Any]:
        cut = finish_reason == "length"
        return {**base, "output": items, "usage": usage_of(chat_usage),
                "status": "incomplete" if cut else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "completed_at": None if cut else int(time.time())}

    def _keep(self, req: ResponsesRequest, response: dict[str, Any],
              messages: list[dict[str, Any]]) -> None:
        if req.store is not False:
            self.store.put(response["id"], messages, response)

    # -- streaming ----------------------------------------------------------------------------

    async def _events(self, req: ResponsesRequest, base: dict[str, Any],
                      conversation: list[dict[str, Any]], chunks: AsyncIterator[Any]
                      ) -> AsyncIterator[str]:
        events = ResponseEvents()
        yield events.event("response.created", response=base)
        yield events.event("response.in_progress", response=base)
        try:
            async for raw in chunks:
                text = raw.decode() if isinstance(raw, bytes) else raw
                data = text.removeprefix("data: ").strip()
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:  # the chat stream failed after it began
                    error = chunk["error"]
                    yield events.event("error", code=error.get("code"),
                                       message=error.get("message", "error"),
                                       param=error.get("param"))
                    return
                for event in events.feed(chunk):
                    yield event
        finally:
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
        if not events.items:  # an empty answer is still one (empty) message
            for event in events.open_message():
                yield event
        for event in events.close():
            yield event
        response = self._finish(base, events.items, events.finish_reason, events.usage)
        message: dict[str, Any] = {"content": None, "tool_calls": []}
        for item in events.items:
            if item["type"] == "message":
                message["content"] = (message["content"] or "") + item["content"][0]["text"]
            elif item["type"] == "function_call":
                message["tool_calls"].append({"id": item["call_id"], "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        self._keep(req, response, conversation + answer_messages(message))
        yield events.event("response.completed", response=response)


def _renamed(e: OpenAIError) -> OpenAIError:
    """A chat-path error, naming the Responses field it came from."""
    param = _PARAMS.get(e.param or "", e.param)
    if param is not None and param.startswith("messages."):
        param = "input"
    message = e.message
    for old, new in (("max_tokens", "max_output_tokens"), ("response_format", "text.format")):
        message = message.replace(old, new)
    return OpenAIError(e.status, message, param=param, code=e.code, type=e.type)

