"""`POST /v1/chat/completions`: messages go through the model's chat template (with the generation
prompt) and become one engine request with `n` sequences. Streaming sends, per choice, a chunk with
the assistant role, then content deltas, then an empty delta carrying finish_reason.

Each choice's text goes through two optional readers, in this order: the reasoning parser
(--reasoning-parser: `<think>...</think>` becomes `reasoning_content`), then, on what remains,
the tool calls (a forced tool choice's JSON, or --tool-call-parser's format for "auto"). A grammar
(structured outputs, forced tool calls) then starts after the reasoning, as the parser does."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tessera.engine.async_engine import EngineError, RequestAbortedError
from tessera.entrypoints.openai.errors import OpenAIError, bad_request
from tessera.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessageOut,
    ChatStreamChoice,
    UsageInfo,
    dump_chunk,
)
from tessera.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    constrain_after_reasoning,
    get_reasoning_parser,
)
from tessera.entrypoints.openai.serving_engine import (
    EngineStreamingResponse,
    OpenAIServing,
    check_output,
    kv_transfer_field,
    merge_streams,
    stream_error_event,
    top_entries,
    top_logprob,
)
from tessera.entrypoints.openai.structured import (
    ToolCallStream,
    constraint_field,
    forces_tool_calls,
    message_dict,
    tool_calls_of,
    tool_finish_reason,
)
from tessera.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from tessera.outputs import CompletionOutput
from tessera.tokenizer import check_chat_template_kwargs

# tokens of the prompt's end decoded to tell whether the template opened or closed a <think>
_PROMPT_TAIL_TOKENS = 8


class OpenAIServingChat(OpenAIServing):
    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        lora = self.check_model(req.model)
        self.check_priority(req.priority)
        if self.tokenizer is None:
            raise bad_request("messages need the model's chat template, but this model has no "
                              "tokenizer, so no chat template: use /v1/completions with token-id "
                              "prompts", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        token_ids = await self.render(req)
        max_tokens = self.resolve_max_tokens(len(token_ids),
                                             req.max_completion_tokens or req.max_tokens)
        params = self.sampling_params(
            req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        prompt_tail = (self.tokenizer.decode(token_ids[-_PROMPT_TAIL_TOKENS:])
                       if self.reasoning_parser is not None else "")
        params = constrain_after_reasoning(params, self._reasoning(prompt_tail), self.tokenizer)
        await self.check_constraint(params, constraint_field(req))
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            # started before the response: a refusal is still an HTTP error, not a 200 + event
            streams = await self.start(base_id, [token_ids], params, req.priority or 0, lora)
            return EngineStreamingResponse(
                self._stream(req, raw_request, base_id, token_ids, streams, prompt_tail),
                self.engine,
                [f"{base_id}-0"])
        finals = await self.run_to_completion(raw_request, base_id, [token_ids], params,
                                              req.priority or 0, lora)
        if finals is None:
            return self.aborted_response()
        final = finals[0]
        choices = [self._choice(req, o, prompt_tail)
                   for o in sorted(final.outputs, key=lambda o: o.index)]
        num_generated = sum(len(o.token_ids) for o in final.outputs)
        usage = UsageInfo(prompt_tokens=len(token_ids), completion_tokens=num_generated,
                          total_tokens=len(token_ids) + num_generated)
        body = ChatCompletionResponse(id=base_id, model=self.model_name_of(req), choices=choices,
                                      usage=usage, **kv_transfer_field(final))
        return Response(body.model_dump_json(), media_type="application/json")

    def _parses_tools(self, req: ChatCompletionRequest) -> bool:
        """Whether the model's own tool calls are parsed from its text ("auto")."""
        return (self.tool_call_parser is not None and bool(req.tools)
                and req.tool_choice in (None, "auto"))

    def _tool_parser(self, req: ChatCompletionRequest) -> ToolParser:
        assert self.tool_call_parser is not None and req.tools
        return get_tool_parser(self.tool_call_parser,
                               [t.function.model_dump(exclude_none=True) for t in req.tools],
                               max_calls=1 if req.parallel_tool_calls is False else None)

    def _reasoning(self, prompt_tail: str) -> ReasoningParser | None:
        if self.reasoning_parser is None:
            return None
        return get_reasoning_parser(self.reasoning_parser, prompt_tail)

    def _choice(self, req: ChatCompletionRequest, o: CompletionOutput,
                prompt_tail: str) -> ChatChoice:
        text: str | None = o.text
        reasoning_content = None
        reasoning = self._reasoning(prompt_tail)
        if reasoning is not None:
            reasoning_content, text = reasoning.extract(o.text)
        if self._parses_tools(req):
            content, parsed = self._tool_parser(req).extract(text or "")
            calls = parsed or None
            message = ChatMessageOut(content=content, tool_calls=parsed)
        else:
            calls = tool_calls_of(req, text or "")
            message = (ChatMessageOut(content=text) if calls is None
                       else ChatMessageOut(content=None, tool_calls=calls))
        message.reasoning_content = reasoning_content
        return ChatChoice(index=o.index, message=message, logprobs=self._logprobs(req, o),
                          finish_reason=tool_finish_reason(req, o.finish_reason, calls),
                          stop_reason=o.stop_reason)

    async def render(self, req: ChatCompletionRequest) -> list[int]:
        """Prompt token ids: the chat template over the messages (and tools), with the
        generation prompt unless the request continues its final message. Checked, then
        rendered off the event loop; a template's refusal is a 400."""
        if req.continue_final_message and req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the "
                              "assistant's", "continue_final_message")
        # vLLM's rule: the two contradict; an explicit add_generation_prompt=true is refused
        if (req.continue_final_message and req.add_generation_prompt
                and "add_generation_prompt" in req.model_fields_set):
            raise bad_request("continue_final_message and add_generation_prompt cannot both "
                              "be true", "continue_final_message")
        try:
            check_chat_template_kwargs(req.chat_template_kwargs)
        except ValueError as e:
            raise bad_request(str(e), "chat_template_kwargs") from None
        conversation = [message_dict(m) for m in req.messages]
        tools = ([t.function.model_dump(exclude_none=True) for t in req.tools]
                 if req.tools and req.tool_choice != "none" else None)
        token_ids = await self.preprocessor.render_chat(
            conversation, "chat_template" if req.chat_template else "messages", tools=tools,
            chat_template=req.chat_template or self.chat_template,
            add_generation_prompt=req.add_generation_prompt is not False,
            continue_final_message=bool(req.continue_final_message),
            chat_template_kwargs=req.chat_template_kwargs)
        if not token_ids:
            raise bad_request("messages render to an empty prompt", "messages")
        return token_ids

    def _logprobs(self, req: ChatCompletionRequest, o: CompletionOutput) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        k = req.top_logprobs or 0
        content = []
        for tid, lps in zip(o.token_ids, o.logprobs or [], strict=False):
            chosen = top_logprob(self.tokenizer, tid, lps.get(tid, float("-inf")))
            content.append(ChatLogprobToken(
                **chosen.model_dump(),
                top_logprobs=[top_logprob(self.tokenizer, t, lp) for t, lp in top_entries(lps, k)],
            ))
        return ChatLogprobs(content=content)

    async def _stream(self, req: ChatCompletionRequest, raw_request: Request, base_id: str,
                      token_ids: list[int], streams, prompt_tail: str) -> AsyncIterator[str]:
        created = int(time.time())
        request_ids = [f"{base_id}-0"]

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return dump_chunk(ChatCompletionChunk(id=base_id, created=created,
                                                  model=self.model_name_of(req), choices=choices,
                                                  usage=usage))

        done = [False] * req.n
        num_generated = 0
        readers = None
        if forces_tool_calls(req) or self._parses_tools(req) or self.reasoning_parser:
            readers = [_ChoiceReader(self._reasoning(prompt_tail),
                                     ToolCallStream(req) if forces_tool_calls(req)
                                     else self._tool_parser(req) if self._parses_tools(req)
                                     else None)
                       for _ in range(req.n)]
        try:
            async with self.abort_on_disconnect(raw_request, request_ids):
                yield chunk([ChatStreamChoice(index=j, delta=ChatDelta(role="assistant",
                                                                       content=""))
                             for j in range(req.n)])
                async for _, out in merge_streams(streams):  # DELTA outputs: only what is new
                    check_output(out)
                    for o in out.outputs:
                        if done[o.index]:
                            continue
                        num_generated += len(o.token_ids)
                        finish_reason = o.finish_reason
                        if readers is not None:
                            reader = readers[o.index]
                            logprobs = self._logprobs(req, o)
                            for delta in reader.feed(o.text, o.finished):
                                yield chunk([ChatStreamChoice(index=o.index, delta=delta,
                                                              logprobs=logprobs)])
                                logprobs = None
                            if logprobs is not None and o.token_ids:  # text held back
                                yield chunk([ChatStreamChoice(index=o.index, delta=ChatDelta(),
                                                              logprobs=logprobs)])
                            if o.finished:
                                finish_reason = tool_finish_reason(
                                    req, o.finish_reason, reader.calls())
                        elif o.text or o.token_ids:
                            yield chunk([ChatStreamChoice(
                                index=o.index, delta=ChatDelta(content=o.text),
                                logprobs=self._logprobs(req, o))])
                        if o.finished:
                            done[o.index] = True
                            yield chunk([ChatStreamChoice(index=o.index, delta=ChatDelta(),
                                                          finish_reason=finish_reason)])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], UsageInfo(prompt_tokens=len(token_ids),
                                          completion_tokens=num_generated,
                                          total_tokens=len(token_ids) + num_generated))
        except (OpenAIError, EngineError, RequestAbortedError) as e:
            yield stream_error_event(e)
        finally:
            self.engine.abort(request_ids)
        yield "data: [DONE]\n\n"


class _ChoiceReader:
    """One streamed choice's text, read by the reasoning parser and then by the tool-call
    reader (a forced tool choice's `ToolCallStream`, or a model-format `ToolParser`)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: Any) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str, finished: bool) -> list[ChatDelta]:
        deltas = []
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, finished)
            if reasoning:
                deltas.append(ChatDelta(reasoning_content=reasoning))
        if self.tools is not None:
            deltas += self.tools.feed(text, finished)
        elif text:
            deltas.append(ChatDelta(content=text))
        return deltas

    def calls(self):
        """The calls sent (for finish_reason), or None."""
        return (self.tools.calls or None) if self.tools is not None else None
