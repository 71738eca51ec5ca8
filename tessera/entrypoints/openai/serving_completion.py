"""`POST /v1/completions`: each prompt becomes one engine request with `n` sequences; prompt i's
sequence j is choice `i * n + j`. Streaming sends each choice's new text as it is decoded."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tessera.engine.async_engine import EngineError, RequestAbortedError
from tessera.entrypoints.openai.errors import OpenAIError, bad_request
from tessera.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    dump_chunk,
)
from tessera.entrypoints.openai.serving_engine import (
    EngineStreamingResponse,
    OpenAIServing,
    check_output,
    clamp_logprob,
    kv_transfer_field,
    merge_streams,
    stream_error_event,
    top_entries,
)
from tessera.entrypoints.openai.structured import constraint_field
from tessera.outputs import CompletionOutput, RequestOutput


class _Prompt:
    def __init__(self, text: str | None, token_ids: list[int]) -> None:
        self.text = text
        self.token_ids = token_ids


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        lora = self.check_model(req.model)
        self.check_priority(req.priority)
        if req.suffix is not None:
            raise bad_request("suffix needs a model with an infill (fill-in-the-middle) mode, and "
                              "this model has none", "suffix")
        if self.tokenizer is None:
            self._check_without_tokenizer(req)
        self.check_logprobs(req.logprobs, "logprobs")
        prompts = await self._prompts(req.prompt)
        if req.kv_transfer_params is not None and len(prompts) > 1:
            raise bad_request("kv_transfer_params moves the KV of one prompt; send one prompt per "
                              "request", "kv_transfer_params")
        if req.truncate_prompt_tokens is not None:  # vLLM's: keep the last N prompt tokens
            for p in prompts:
                if len(p.token_ids) > req.truncate_prompt_tokens:
                    p.token_ids = p.token_ids[-req.truncate_prompt_tokens:]
                    p.text = None  # echo returns what the model saw
        for p in prompts:
            self.resolve_max_tokens(len(p.token_ids), req.max_tokens)
        params = self.sampling_params(
            req, max_tokens=req.max_tokens, logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if req.echo else None,
        )
        await self.check_constraint(params, constraint_field(req))
        base_id = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            # started before the response: a refusal is still an HTTP error, not a 200 + event
            streams = await self.start(base_id, [p.token_ids for p in prompts], params,
                                       req.priority or 0, lora)
            request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
            return EngineStreamingResponse(
                self._stream(req, raw_request, base_id, prompts, streams), self.engine,
                request_ids)
        finals = await self.run_to_completion(raw_request, base_id, [p.token_ids for p in prompts],
                                              params, req.priority or 0, lora)
        if finals is None:
            return self.aborted_response()
        choices: list[CompletionChoice] = []
        usage = UsageInfo()
        for i, (prompt, out) in enumerate(zip(prompts, finals, strict=True)):
            usage.prompt_tokens += len(prompt.token_ids)
            for o in sorted(out.outputs, key=lambda o: o.index):
                usage.completion_tokens += len(o.token_ids)
                choices.append(self._choice(req, i * req.n + o.index, prompt, out, o, True))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        body = CompletionResponse(id=base_id, model=self.model_name_of(req), choices=choices,
                                  usage=usage, **kv_transfer_field(finals[0]))
        return Response(body.model_dump_json(), media_type="application/json")

    def _check_without_tokenizer(self, req: CompletionRequest) -> None:
        """A model without a tokenizer takes token ids and returns token ids (and no text): every
        field that needs text is the client's mistake, refused here rather than deep in a handler
        or in the engine."""
        if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], str)):
            raise bad_request("prompt is text, but this model has no tokenizer: send token ids "
                              "(a list of ints, or a list of such lists)", "prompt")
        if req.echo:
            raise bad_request("echo requires a tokenizer (to return the prompt as text), and "
                              "this model has none", "echo")
        if req.logprobs is not None:
            raise bad_request("logprobs requires a tokenizer (to name each token), and this "
                              "model has none", "logprobs")
        if req.stop:
            raise bad_request("stop requires a tokenizer (stop strings match text), and this "
                              "model has none", "stop")

    async def _prompts(self, prompt: str | list) -> list[_Prompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        prompts = []
        for i, p in enumerate(prompt):  # every text checked before any is tokenized
            if isinstance(p, str):
                self.preprocessor.check_text(p, "prompt" if len(prompt) == 1 else f"prompt.{i}")
        for i, p in enumerate(prompt):
            param = "prompt" if len(prompt) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                token_ids = await self.preprocessor.encode(p, param)
                if not token_ids:
                    raise bad_request(f"{param} must not be empty", param)
                prompts.append(_Prompt(p, token_ids))
            else:
                self.check_token_ids(p, param)
                prompts.append(_Prompt(None, list(p)))
        return prompts

    def _choice(self, req: CompletionRequest, index: int, prompt: _Prompt, out: RequestOutput,
                o: CompletionOutput, first: bool) -> CompletionChoice:
        """The choice for `o`'s text and tokens (a delta when streaming, all of it otherwise);
        `first` marks the choice's first chunk, which carries the echoed prompt."""
        text = o.text
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if first and req.echo:
                self._add_prompt_logprobs(logprobs, prompt, out, req.logprobs)
            for tid, lps in zip(o.token_ids, o.logprobs or [], strict=False):
                self._add_logprob(logprobs, tid, lps.get(tid), lps, req.logprobs)
        if first and req.echo:
            text = self._prompt_text(prompt) + text
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=o.finish_reason, stop_reason=o.stop_reason)

    def _prompt_text(self, prompt: _Prompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids)
        return prompt.text

    def _add_prompt_logprobs(self, logprobs: CompletionLogprobs, prompt: _Prompt,
                             out: RequestOutput, k: int) -> None:
        entries = out.prompt_logprobs or [None] * len(prompt.token_ids)
        for tid, lps in zip(prompt.token_ids, entries, strict=False):
            self._add_logprob(logprobs, tid, None if lps is None else lps.get(tid), lps, k)

    def _add_logprob(self, logprobs: CompletionLogprobs, token_id: int, logprob: float | None,
                     alternatives: dict[int, float] | None, k: int) -> None:
        token = self.tokenizer.decode([token_id])
        offset = (logprobs.text_offset[-1] + len(logprobs.tokens[-1])) if logprobs.tokens else 0
        logprobs.tokens.append(token)
        logprobs.token_logprobs.append(None if logprob is None else clamp_logprob(logprob))
        logprobs.text_offset.append(offset)
        if alternatives is None:
            logprobs.top_logprobs.append(None)
        else:
            logprobs.top_logprobs.append(
                {self.tokenizer.decode([t]): lp for t, lp in top_entries(alternatives, k)})

    async def _stream(self, req: CompletionRequest, raw_request: Request, base_id: str,
                      prompts: list[_Prompt], streams) -> AsyncIterator[str]:
        created = int(time.time())
        request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        started: set[int] = set()  # choice indexes that sent their first chunk
        finished: set[int] = set()
        usage = UsageInfo(prompt_tokens=sum(len(p.token_ids) for p in prompts))
        try:
            async with self.abort_on_disconnect(raw_request, request_ids):
                async for i, out in merge_streams(streams):  # DELTA outputs: only what is new
                    check_output(out)
                    choices = []
                    for o in out.outputs:
                        index = i * req.n + o.index
                        if index in finished:
                            continue
                        first = index not in started
                        if not o.text and not o.token_ids and not (
                                o.finished or (first and req.echo)):
                            continue
                        choices.append(self._choice(req, index, prompts[i], out, o, first))
                        started.add(index)
                        usage.completion_tokens += len(o.token_ids)
                        if o.finished:
                            finished.add(index)
                    if choices:
                        yield dump_chunk(CompletionResponse(
                            id=base_id, created=created, model=self.model_name_of(req),
                            choices=choices))
            if req.stream_options and req.stream_options.include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield dump_chunk(CompletionResponse(id=base_id, created=created,
                                                    model=self.model_name_of(req), choices=[],
                                                    usage=usage))
        except (OpenAIError, EngineError, RequestAbortedError) as e:
            yield stream_error_event(e)
        finally:
            self.engine.abort(request_ids)
        yield "data: [DONE]\n\n"
