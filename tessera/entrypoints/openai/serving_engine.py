"""What both POST endpoints share: checks against the model, SamplingParams, launching one engine
request per prompt, merging their streams, and aborting them when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tessera.config import SchedulingPolicy
from tessera.engine.async_engine import (
    AsyncLLMEngine,
    EngineError,
    EngineShutdownError,
    RequestAbortedError,
)
from tessera.entrypoints.openai.errors import OpenAIError, bad_request, error_body
from tessera.entrypoints.openai.preprocess import Preprocessor
from tessera.entrypoints.openai.protocol import TopLogprob, _SamplingRequest
from tessera.entrypoints.openai.serving_models import ServingModels
from tessera.entrypoints.openai.structured import structured_outputs_of
from tessera.inputs import InvalidTokenIdError, check_token_ids
from tessera.lora.request import LoRARequest
from tessera.outputs import RequestOutput
from tessera.sampling.params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
_DONE = object()
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI clients expect a number


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_name: str,
                 preprocessor: Preprocessor, chat_template: str | None = None,
                 sampling_defaults: dict | None = None, log_requests: bool = False,
                 tool_call_parser: str | None = None, models: ServingModels | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        # the names requests may give as `model`: the base and any LoRA adapters
        self.models = models or ServingModels(engine, served_model_name)
        self.chat_template = chat_template  # --chat-template: replaces the model's
        # --generation-config: the model's defaults for fields a request leaves unset
        self.sampling_defaults = dict(sampling_defaults or {})
        self.log_requests = log_requests  # --enable-log-requests
        # --enable-auto-tool-choice --tool-call-parser NAME: tool_choice "auto" is parsed
        self.tool_call_parser = tool_call_parser
        # --reasoning-parser NAME: <think>...</think> becomes reasoning_content (chat)
        self.reasoning_parser = reasoning_parser
        self.tokenizer = engine.tokenizer
        self.preprocessor = preprocessor  # tokenizes off the event loop, after the cheap checks
        self.max_model_len = engine.max_model_len
        self.max_logprobs = engine.max_logprobs
        self.vocab_size = engine.vocab_size
        # AsyncLLMEngine does not surface the policy; the wrapped engine's config is its one home
        self.scheduling_policy: SchedulingPolicy = engine.scheduling_policy

    # -- checks ---------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); a 404 for an unknown name."""
        return self.models.resolve(model)

    def model_name_of(self, req) -> str:
        """The `model` a response reports: the adapter's name, or the served model name."""
        return req.model if req.model in self.models.adapters else self.served_model_name

    def check_priority(self, priority: int | None) -> None:
        """As vLLM: a priority other than 0 means something only under --scheduling-policy
        priority; under fcfs it would be silently ignored, so it is refused."""
        if priority and self.scheduling_policy is not SchedulingPolicy.PRIORITY:
            raise bad_request(f"priority ({priority}) needs --scheduling-policy priority; this "
                              f"server schedules {self.scheduling_policy.value} (send priority 0 "
                              "or leave it out)", "priority")

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request(f"{param} must not be empty", param)
        try:
            check_token_ids(token_ids, self.vocab_size, param)  # the rule's home: tessera/inputs.py
        except InvalidTokenIdError as e:
            raise bad_request(f"{param} holds token id {e.token_id!r}, outside the vocabulary "
                              f"[0, {self.vocab_size})", param) from None

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The request's max_tokens, checked against max_model_len (default: the model's
        max_new_tokens when its generation config has one, else what is left)."""
        limit = self.max_model_len
        if max_tokens is None and "max_tokens" in self.sampling_defaults:
            max_tokens = min(self.sampling_defaults["max_tokens"], limit - num_prompt_tokens)
            max_tokens = max(max_tokens, 1)
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise bad_request(f"this model's maximum context length is {limit} tokens, but "
                                  f"the prompt has {num_prompt_tokens} tokens", "messages")
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens, but "
                f"{num_prompt_tokens + max_tokens} "
                f"were requested ({num_prompt_tokens} in the prompt + {max_tokens} max_tokens); "
                "shorten the prompt or lower max_tokens",
                "max_tokens",
            )
        return max_tokens

    def check_logprobs(self, value: int | None, param: str) -> None:
        """As vLLM: at most --max-logprobs alternatives per token."""
        if value is not None and value > self.max_logprobs:
            raise bad_request(f"{param} ({value}) exceeds the server's --max-logprobs "
                              f"({self.max_logprobs})", param)

    def sampling_params(self, req: _SamplingRequest, max_tokens: int | None,
                        **kw) -> SamplingParams:
        """SamplingParams from the request; unset fields keep SamplingParams' defaults."""
        if req.n > self.engine.max_num_seqs:
            raise bad_request(f"n ({req.n}) exceeds the server's --max-num-seqs "
                              f"({self.engine.max_num_seqs})", "n")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        fields = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "stop", "ignore_eos", "min_tokens",
                  "logit_bias", "stop_token_ids", "allowed_token_ids",
                  "include_stop_str_in_output", "skip_special_tokens", "kv_transfer_params")
        args = {k: v for k, v in self.sampling_defaults.items() if k != "max_tokens"}
        args.update({name: getattr(req, name) for name in fields if getattr(req, name) is not None})
        args.update({k: v for k, v in kw.items() if v is not None})
        args["max_tokens"] = max_tokens
        args["structured_outputs"] = structured_outputs_of(req, self.tool_call_parser is not None)
        # a stream forwards what is new; a whole answer needs only the final output
        args["output_kind"] = (
            RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        )
        try:
            params = SamplingParams(**args)
            params.check_vocab(self.vocab_size)
        except ValueError as e:  # SamplingParams' messages start with the field's name
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from None
        return params

    async def check_constraint(self, params: SamplingParams, param: str) -> None:
        """Compile the request's grammar (cached) off the event loop: an invalid schema, regex
        or grammar is a 400 naming `param`, before any stream starts."""
        if params.structured_outputs is None:
            return
        try:
            await self.engine.check_constraints(params)
        except ValueError as e:
            raise bad_request(str(e), param) from None

    # -- running ------------------------------------------------------------------------------

    async def start(self, base_id: str, prompts: list[list[int]], params: SamplingParams,
                    priority: int, lora_request: LoRARequest | None = None,
                    ) -> list[AsyncIterator[RequestOutput]]:
        """Add one engine request per prompt; if any is refused, abort the others."""
        streams: list[AsyncIterator[RequestOutput]] = []
        if self.log_requests:
            logger.info("request %s: %d prompt(s) of %s tokens, %s", base_id, len(prompts),
                        [len(p) for p in prompts], params)
        try:
            for i, token_ids in enumerate(prompts):
                sp = params if len(prompts) == 1 else params.clone()
                lora = {} if lora_request is None else {"lora_request": lora_request}
                streams.append(await self.engine.add_request(f"{base_id}-{i}", token_ids, sp,
                                                             priority, **lora))
        except BaseException as e:
            # a stream not yet iterated has no running `finally`: abort by id
            self.engine.abort([f"{base_id}-{i}" for i in range(len(streams))])
            if isinstance(e, ValueError):  # the engine's own checks (they name the field)
                raise bad_request(str(e), str(e).split(" ", 1)[0]) from None
            if isinstance(e, EngineShutdownError):
                raise OpenAIError(503, str(e), code="service_unavailable") from None
            if isinstance(e, EngineError):
                raise OpenAIError(500, str(e)) from None
            raise
        return streams

    async def run_to_completion(
        self, raw_request: Request, base_id: str, prompts: list[list[int]], params: SamplingParams,
        priority: int, lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput] | None:
        """The non-streaming path: run one engine request per prompt to its final output (in prompt
        order). None if they were aborted (client disconnect or shutdown: answer with
        `aborted_response`); an engine failure is a 500; nothing is left running either way."""
        request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        finals: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async with self.abort_on_disconnect(raw_request, request_ids):
                streams = await self.start(base_id, prompts, params, priority, lora_request)
                async for i, out in merge_streams(streams):
                    check_output(out)
                    finals[i] = out
        except RequestAbortedError:
            return None
        except EngineError as e:
            raise OpenAIError(500, str(e)) from None
        finally:
            self.engine.abort(request_ids)  # no-op for finished requests
        assert all(out is not None and out.finished for out in finals)
        return finals  # type: ignore[return-value]

    def aborted_response(self) -> Response:
        """A non-streaming request was aborted: by shutdown (tell the client), or because the
        client left (nobody reads this; 499 is nginx's 'client closed request' for the logs)."""
        if not self.engine.is_accepting:
            raise OpenAIError(503, "the server is shutting down", code="service_unavailable")
        return Response(status_code=499)

    @contextlib.asynccontextmanager
    async def abort_on_disconnect(self, request: Request, request_ids: list[str]):
        """While inside, a client disconnect aborts `request_ids` (their streams then raise
        RequestAbortedError), whether or not a first token was sent."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.engine.abort(request_ids)

        watcher = asyncio.create_task(watch())
        try:
            yield
        finally:
            watcher.cancel()


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, output) from several request streams as they arrive. Closing this
    generator (or an error in one stream) closes all of them, which aborts the unfinished ones."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                merged.put_nowait((i, out))
        except Exception as e:
            merged.put_nowait((i, e))
        finally:
            merged.put_nowait((i, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await merged.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def kv_transfer_field(out: RequestOutput) -> dict:
    """The response's `kv_transfer_params` (a KV producer's finished request), or nothing."""
    return {} if out.kv_transfer_params is None else {"kv_transfer_params": out.kv_transfer_params}


def check_output(out: RequestOutput) -> None:
    """An engine-side rejection (e.g. prompt over max_model_len) becomes a 400."""
    if out.error is not None:
        raise bad_request(out.error, "prompt")


def stream_error_event(e: BaseException) -> str:
    """The SSE event for an error that ends a stream after its first chunk (one refused before
    that is an HTTP error instead: the engine requests are started before the response is)."""
    if isinstance(e, OpenAIError):
        body = error_body(e.status, e.message, type=e.type, param=e.param, code=e.code)
    elif isinstance(e, RequestAbortedError):
        body = error_body(503, str(e), code="aborted")
    elif isinstance(e, EngineError):  # our messages, written for clients
        body = error_body(500, str(e))
    else:
        body = error_body(500, f"internal error ({type(e).__name__})")
    return f"data: {json.dumps(body)}\n\n"


class EngineStreamingResponse(StreamingResponse):
    """An SSE response over engine requests that were started before it: whatever becomes of the
    response (finished, failed, the client gone before the first byte), its requests are aborted
    when it ends, so none keeps running for nobody."""

    def __init__(self, content, engine: AsyncLLMEngine, request_ids: list[str]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._engine = engine
        self._request_ids = request_ids

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine.abort(self._request_ids)


def clamp_logprob(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def top_entries(logprobs: dict[int, float], k: int) -> Iterator[tuple[int, float]]:
    """The k most likely (token id, logprob) pairs, best first."""
    ranked = sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)
    for tid, lp in ranked[:k]:
        yield tid, clamp_logprob(lp)


def top_logprob(tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text = tokenizer.decode([token_id])
    return TopLogprob(token=text, logprob=clamp_logprob(logprob), bytes=list(text.encode()))
