"""Pydantic models of the OpenAI-compatible HTTP API (requests strict, responses as OpenAI sends
them).

Requests forbid unknown fields: a parameter we do not support is a 400 naming it, never silently
ignored. Ranges live in `Field(...)` so the generated OpenAPI schema documents them (and the fuzz
tests draw from it); checks that need the model (context length, vocabulary) are in the serving
code.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tessera.sampling.params import (
    INT32_MAX,
    MAX_ABS_PENALTY,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STR_LEN,
    MAX_STOP_STRINGS,
    SEED_MAX,
    SEED_MIN,
)

# prompts in one /v1/completions request (each becomes an engine request with n sequences)
MAX_PROMPTS_PER_REQUEST = 64
# characters of one chat message or text part; the prompt's own bound (max_model_len tokens)
# is checked before tokenization, in the serving code
MAX_TEXT_CHARS = 4 * 2**20


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool | None = False


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` shadows a BaseModel attribute in pydantic, hence the alias
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
_StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STR_LEN)]


class _SamplingRequest(_Request):
    """Fields common to both POST endpoints: OpenAI's, then vLLM's extras."""

    model: str | None = Field(None, description="the served model name; default: the only one")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: _StopStr | Annotated[list[_StopStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="end-user id; accepted, not used")
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX,
                              description="-1 or 0: off; above the vocabulary size: off")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0, le=INT32_MAX)
    priority: int | None = Field(0, ge=-(2**31), le=2**31 - 1,
                                 description="lower runs first under --scheduling-policy priority; "
                                             "must be 0 under fcfs")
    # token-level steering (OpenAI's logit_bias; vLLM's extras)
    logit_bias: Annotated[dict[str, float], Field(max_length=1024)] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = (
        None
    )
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # disaggregated prefill/decode (vLLM's): to a producer {"do_remote_decode": true}; to a
    # consumer the kv_transfer_params of the producer's response
    kv_transfer_params: dict[str, Any] | None = None
    # sent by SDKs and agent frameworks; they change nothing on a self-hosted server
    store: bool | None = Field(None, description="accepted; nothing is stored")
    metadata: dict[str, str] | None = Field(None, description="accepted; not used")
    service_tier: str | None = Field(None, description="accepted; there is one tier")


_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(min_length=1)]
_Many = Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)
Prompt = _Text | Annotated[list[_Text], _Many] | _TokenIds | Annotated[list[_TokenIds], _Many]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt = Field(description="a string, strings, token ids, or lists of token ids")
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX,
                                 description="at most the server's --max-logprobs (default 20)")
    echo: bool | None = False
    suffix: str | None = Field(None, description="refused: the model has no infill mode")
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="keep the last N tokens")


class TextPart(_Request):
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call this answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX,
                                   description="default: what is left of the context")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX,
                                              description="same as max_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX,
                                     description="at most the server's --max-logprobs (default 20)")
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one tool call (the grammar of tool_choice \"required\" "
                          "allows one; a parsed \"auto\" output keeps its first)")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="accepted; the default model has no reasoning mode")
    # vLLM's chat extras
    chat_template: str | None = Field(None, description="a Jinja template replacing the model's")
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='extra variables for the chat template, e.g. {"enable_thinking": false}')


# -- responses ---------------------------------------------------------------------------------


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprobToken] | None = None


class FunctionCallOut(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(_Response):
    id: str | None = None
    type: Literal["function"] | None = "function"
    function: FunctionCallOut


class DeltaToolCall(ToolCallOut):
    index: int = 0


class ChatMessageOut(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # --reasoning-parser: the model's thinking, apart from its answer (vLLM's field)
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tessera"
    root: str | None = None  # the model's path; a LoRA adapter's directory
    parent: str | None = None  # a LoRA adapter's base model (None for the base itself)
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


def dump_chunk(chunk: BaseModel) -> str:
    """One SSE event. `None` fields inside a delta are dropped (OpenAI sends `{"content": "x"}`)."""
    data: dict[str, Any] = chunk.model_dump(exclude_none=False)
    for choice in data.get("choices", []):
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    if data.get("usage") is None:
        data.pop("usage", None)
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


# -- /tokenize and /detokenize (vLLM's shapes) ---------------------------------------------------


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(_Response):
    prompt: str


class LoadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=256,
                           description="the name clients then send as `model`")
    lora_path: str = Field(min_length=1, max_length=4096,
                           description="a directory in PEFT's format (adapter_config.json + "
                                       "adapter_model.safetensors)")


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = Field(None, description="accepted, as vLLM does; the name decides")
