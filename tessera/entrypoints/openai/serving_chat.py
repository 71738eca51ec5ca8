"""`POST /v1/chat/completions`: messages go through the model's chat template (with the generation
prompt) and become one engine request with `n` sequences. Streaming sends, per choice, a chunk with
the assistant role, then content deltas, then an empty delta carrying finish_reason."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

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
    AutoToolCallStream,
    ToolCallStream,
    constraint_field,
    forces_tool_calls,
    message_dict,
    tool_calls_of,
    tool_finish_reason,
)
from tessera.entrypoints.openai.tool_parsers import TOOL_PARSERS
from tessera.outputs import CompletionOutput


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
        await self.check_constraint(params, constraint_field(req))
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            # started before the response: a refusal is still an HTTP error, not a 200 + event
            streams = await self.start(base_id, [token_ids], params, req.priority or 0, lora)
            return EngineStreamingResponse(
                self._stream(req, raw_request, base_id, token_ids, streams), self.engine,
                [f"{base_id}-0"])
        finals = await self.run_to_completion(raw_request, base_id, [token_ids], params,
                                              req.priority or 0, lora)
        if finals is None:
            return self.aborted_response()
        final = finals[0]
        choices = [self._choice(req, o) for o in sorted(final.outputs, key=lambda o: o.index)]
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

    def _choice(self, req: ChatCompletionRequest, o: CompletionOutput) -> ChatChoice:
        if self._parses_tools(req):
            content, parsed = TOOL_PARSERS[self.tool_call_parser].extract(o.text)
            calls = parsed or None
            message = ChatMessageOut(content=content, tool_calls=parsed)
        else:
            calls = tool_calls_of(req, o.text)
            message = (ChatMessageOut(content=o.text) if calls is None
                       else ChatMessageOut(content=None, tool_calls=calls))
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
        conversation = [message_dict(m) for m in req.messages]
        tools = ([t.function.model_dump(exclude_none=True) for t in req.tools]
                 if req.tools and req.tool_choice != "none" else None)
        token_ids = await self.preprocessor.render_chat(
            conversation, "chat_template" if req.chat_template else "messages", tools=tools,
            chat_template=req.chat_template or self.chat_template,
            add_generation_prompt=req.add_generation_prompt is not False,
            continue_final_message=bool(req.continue_final_message))
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
                      token_ids: list[int], streams) -> AsyncIterator[str]:
        created = int(time.time())
        request_ids = [f"{base_id}-0"]

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return dump_chunk(ChatCompletionChunk(id=base_id, created=created,
                                                  model=self.model_name_of(req), choices=choices,
                                                  usage=usage))

        done = [False] * req.n
        num_generated = 0
        tool_streams = None
        if forces_tool_calls(req):
            tool_streams = [ToolCallStream(req) for _ in range(req.n)]
        elif self._parses_tools(req):
            tool_streams = [AutoToolCallStream(TOOL_PARSERS[self.tool_call_parser]())
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
                        if tool_streams is not None:
                            delta = tool_streams[o.index].feed(o.text, o.finished)
                            if delta is not None:
                                yield chunk([ChatStreamChoice(index=o.index, delta=delta)])
                            if o.finished:
                                finish_reason = tool_finish_reason(
                                    req, o.finish_reason, tool_streams[o.index].calls)
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
