"""Where a request's output constraint comes from, and what tools turn into.

A request names at most one constraint, by any of the spellings clients use:
- OpenAI's `response_format` (`json_object`, or `json_schema` with a schema);
- vLLM's `structured_outputs: {json | regex | choice | grammar | json_object}`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- chat `tools` with `tool_choice` "required" (a JSON array of calls, each one of the tools with
  arguments matching its parameters) or a named function (its parameters schema).

Each becomes one `StructuredOutputsParams`; two at once is a 400 naming the second.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tessera.entrypoints.openai.errors import bad_request
from tessera.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    DeltaToolCall,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallOut,
    _SamplingRequest,
)
from tessera.sampling.structured_outputs import StructuredOutputsParams

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def structured_outputs_of(req: _SamplingRequest, auto_tools: bool = False
                          ) -> StructuredOutputsParams | None:
    """The request's one constraint, or None; a 400 naming the field when it is malformed.
    `auto_tools`: the server parses the model's own tool calls (`tool_choice: "auto"`)."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        else:
            if rf.json_schema is None:
                raise bad_request("response_format of type json_schema needs json_schema",
                                  "response_format")
            found.append(("response_format",
                          {"json": rf.json_schema.json_schema or _ANY_OBJECT}))
    if req.structured_outputs is not None:
        so = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", so))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if isinstance(req, ChatCompletionRequest):
        tools = tool_constraint(req, auto_tools)
        if tools is not None:
            found.append(("tool_choice", tools))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"{found[1][0]} cannot be combined with {found[0][0]}: a request takes "
                          "one output constraint", found[1][0])
    field_name, spec = found[0]
    try:
        return StructuredOutputsParams.from_dict(spec)
    except ValueError as e:
        raise bad_request(f"{field_name}: {e}", field_name) from None


def tool_constraint(req: ChatCompletionRequest, auto_tools: bool = False
                    ) -> dict[str, Any] | None:
    """The constraint `tools` + `tool_choice` put on the output (None: unconstrained, which
    "auto" is when the server parses the model's own tool-call format)."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if auto_tools:
            return None
        raise bad_request('tool_choice "auto" (the default with tools) needs a parser for the '
                          "model's own tool-call format: start the server with "
                          "--enable-auto-tool-choice --tool-call-parser NAME (hermes, "
                          "llama3_json, mistral, pythonic or qwen3_xml), or send "
                          'tool_choice "required" or a named function', "tool_choice")
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in req.tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in "
                              "tools", "tool_choice")
        return {"json": tool.function.parameters or _ANY_OBJECT}
    # "required": at least one call, each to one of the tools with arguments matching it;
    # exactly one under parallel_tool_calls: false
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": t.function.parameters or _ANY_OBJECT},
              "required": ["name", "parameters"]} for t in req.tools]
    array: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if req.parallel_tool_calls is False:
        array["maxItems"] = 1
    return {"json": array}


def tool_calls_of(req: ChatCompletionRequest, text: str) -> list[ToolCallOut] | None:
    """The tool calls a constrained output stands for (None when tools were not forced).

    The grammar guarantees the shape; an output cut short by max_tokens may not parse, and is
    then returned as content (finish_reason "length" tells the client why)."""
    choice = req.tool_choice
    if not req.tools or choice in (None, "none", "auto"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(choice, NamedToolChoice):
        return [_call(choice.function.name, value)]
    return [_call(c["name"], c["parameters"]) for c in value]


def _call(name: str, arguments: Any) -> ToolCallOut:
    return ToolCallOut(id=f"chatcmpl-tool-{uuid.uuid4().hex}",
                       function=FunctionCallOut(name=name, arguments=json.dumps(arguments)))


def forces_tool_calls(req: ChatCompletionRequest) -> bool:
    """Whether the output is a tool call by construction ("required" or a named function)."""
    return bool(req.tools) and req.tool_choice not in (None, "none", "auto")


def tool_finish_reason(req: ChatCompletionRequest, finish_reason: str | None,
                       calls: list[ToolCallOut] | None) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call ("required"); a forced named function
    ends with "stop"; an output cut short keeps "length"."""
    if calls is None or finish_reason != "stop":
        return finish_reason
    return "stop" if isinstance(req.tool_choice, NamedToolChoice) else "tool_calls"


class ToolCallStream:
    """Turns one choice's streamed text into tool-call deltas, in OpenAI's streaming shape.

    A named function's arguments stream as they are generated (its name is known up front). The
    calls of "required" are a JSON array whose element boundaries are only certain once it
    parses, so they are sent whole, when the output ends."""

    def __init__(self, req: ChatCompletionRequest) -> None:
        self.req = req
        self.named = req.tool_choice.function.name if isinstance(
            req.tool_choice, NamedToolChoice) else None
        self.text = ""
        self.started = False
        self.calls: list[ToolCallOut] | None = None

    def feed(self, new_text: str, finished: bool) -> list[ChatDelta]:
        """The deltas to stream after `new_text` (often none)."""
        self.text += new_text
        if finished:
            self.calls = tool_calls_of(self.req, self.text)
        if self.named is not None:
            if not new_text and self.started:
                return []
            call = DeltaToolCall(index=0, function=FunctionCallOut(arguments=new_text))
            if not self.started:
                self.started = True
                call.id = f"chatcmpl-tool-{uuid.uuid4().hex}"
                call.function.name = self.named
            else:
                call.id = call.type = None
            return [ChatDelta(tool_calls=[call])]
        if not finished:
            return []
        if self.calls is None:  # cut short: what there is, as content
            return [ChatDelta(content=self.text)] if self.text else []
        return [ChatDelta(tool_calls=[DeltaToolCall(index=k, id=c.id, function=c.function)
                                      for k, c in enumerate(self.calls)])]


def constraint_field(req: _SamplingRequest) -> str:
    """The request field a constraint came from (for the `param` of a 400)."""
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"):
        if getattr(req, name) is not None:
            return name
    return "tool_choice"


def message_dict(m: ChatMessage) -> dict[str, Any]:
    """A chat message as templates read it. Templates know system/user/assistant/tool; OpenAI's
    newer `developer` is a system turn; tool-call arguments are given as objects, as HF
    templates expect."""
    message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": m.text()}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
