"""Pydantic models of `POST /v1/responses`: the core of OpenAI's Responses API (requests strict, as
in protocol.py: a field we do not honour is a 400 naming it).

Input items are the three kinds a function-calling conversation needs: `message` (a turn; its
`type` may be left out, as the SDKs do), `function_call` (the model's call, sent back) and
`function_call_output` (the caller's result for a `call_id`). A `reasoning` item sent back is
accepted and skipped (models do not read their earlier reasoning).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from tessera.entrypoints.openai.protocol import MAX_TEXT_CHARS, _Request
from tessera.sampling.params import (
    INT32_MAX,
    MAX_ABS_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STR_LEN,
    MAX_STOP_STRINGS,
    SEED_MAX,
    SEED_MIN,
)

_Status = Literal["in_progress", "completed", "incomplete"]
_LongText = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class ContentPart(_Request):
    """`input_text`, or `output_text` where an assistant turn is sent back."""

    type: Literal["input_text", "output_text"]
    text: _LongText
    annotations: list[Any] | None = None  # on an output_text sent back; not used
    logprobs: list[Any] | None = None


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: _LongText | list[ContentPart]
    id: str | None = None
    status: _Status | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: _LongText
    id: str | None = None
    status: _Status | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: _LongText
    id: str | None = None
    status: _Status | None = None


class ReasoningItem(_Request):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: _Status | None = None


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    """`text` (plain), `json_object`, or `json_schema` with `name` and `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    # `schema` shadows a BaseModel attribute in pydantic, hence the alias
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: str | None = Field(None, description="the served model name; default: the only one")
    input: _LongText | Annotated[list[InputItem], Field(max_length=4096)] = Field(
        description="a user message, or a list of message / function_call / "
                    "function_call_output items")
    instructions: _LongText | None = Field(
        None, description="a system message put first; not carried over by previous_response_id")
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = Field(True, description="keep the response (in memory) so that a later "
                                                 "request can continue it by previous_response_id")
    previous_response_id: str | None = Field(None, description="continue that stored response")
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = Field(
        None, description="returned with the response")
    # vLLM's extras (sampling, chat template variables), passed to the chat path as they are
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    stop: (Annotated[str, Field(min_length=1, max_length=MAX_STOP_STR_LEN)]
           | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STR_LEN)]],
                       Field(max_length=MAX_STOP_STRINGS)] | None) = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    logit_bias: Annotated[dict[str, float], Field(max_length=1024)] | None = None
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    # vLLM's chat extra: variables for the chat template (Qwen3's `enable_thinking`)
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra chat template variables, e.g. {\"enable_thinking\": false}")


# the extras above, by name (what `/v1/responses` hands to the chat path unchanged)
CHAT_EXTRAS = ("seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "stop", "ignore_eos", "min_tokens", "logit_bias",
                   "priority", "chat_template_kwargs")
