"""A small deterministic stand-in for `LLMEngine` (same interface) so the server and the async
engine can be tested in milliseconds.

Tokens are bytes (vocab 256). Greedy output of a request is the cycle `a b c ... z a ...` starting
at
letter (prompt length % 26); a seeded sampled sequence k starts at (seed + k) % 26 instead. Each
step advances every running request by one token and sleeps `step_delay` (as a model would, with the
GIL released). A prompt containing "__boom__" makes the next step raise. `tokenizer=False` is a bare
checkpoint: token ids in, token ids out, no text (as `LLMEngine` with `tokenizer is None`).
An embedding request (`PoolingParams`) finishes in one step with the vector
[prompt length, sum of its ids % 97, 1.0].

Tests wait on `wait_until(predicate)`: every change of the fake's requests notifies a condition, so
a
waiter wakes when the engine thread has added, stepped or aborted, instead of polling.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from tessera.config import SchedulingPolicy
from tessera.engine.stats import EngineStats, StatsSnapshot
from tessera.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from tessera.pooling_params import PoolingParams
from tessera.sampling.params import RequestOutputKind, SamplingParams


class FakeTokenizer:
    chat_template = "fake"
    eos_token_id = 0

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [chr(t) for t in token_ids]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True,
                            return_dict=False, tools=None, chat_template=None,
                            continue_final_message=False):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if continue_final_message:
            text = text.removesuffix("\n")
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    outputs: list[CompletionOutput] = field(default_factory=list)
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)  # DELTA: (chars, tokens) out
    first_token_time: float | None = None
    pooling: bool = False  # an embedding request


class FakeEngine:
    def __init__(self, max_model_len: int = 128, max_num_seqs: int = 8, step_delay: float = 0.005,
                 tokenizer: bool = True, scheduling_policy: str = "fcfs"):
        self.config = SimpleNamespace(
            model=SimpleNamespace(max_model_len=max_model_len),
            scheduler=SimpleNamespace(max_num_seqs=max_num_seqs,
                                      scheduling_policy=SchedulingPolicy(scheduling_policy)))
        self.tokenizer = FakeTokenizer() if tokenizer else None
        self.model_name = "fake-model"
        self.vocab_size = 256
        self.step_delay = step_delay
        self.requests: dict[str, _Req] = {}
        self.num_steps = 0
        self.num_aborted = 0
        self.priorities: list[int] = []  # of every accepted request, in order
        self.generation_tokens = 0
        self.stats = EngineStats()  # the real engine's step/abort statistics, fed by the fake
        self._boom = False
        self._changed = threading.Condition()  # notified after every change of `requests`

    def wait_until(self, predicate, timeout: float = 5.0):
        """Block until `predicate()` (evaluated under the fake's lock) is true; its value."""
        with self._changed:
            value = self._changed.wait_for(predicate, timeout)
        assert value, f"condition not reached in {timeout} s; requests: {list(self.requests)}"
        return value

    # -- the LLMEngine interface ---------------------------------------------------------------

    def add_request(self, request_id, prompt, sampling_params, priority=0, arrival_time=None):
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        if b"__boom__" in bytes(t % 256 for t in token_ids):
            self._boom = True
        req = _Req(request_id, prompt if isinstance(prompt, str) else None, token_ids,
                   sampling_params, arrival_time or time.monotonic())
        if isinstance(sampling_params, PoolingParams):
            req.pooling = True
        else:
            req.outputs = [CompletionOutput(
                index=i, text="", token_ids=[],
                logprobs=[] if sampling_params.logprobs is not None else None)
                for i in range(sampling_params.n)]
        with self._changed:
            self.requests[request_id] = req
            self.priorities.append(priority)
            self._changed.notify_all()

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._changed:
            for rid in ids:
                if self.requests.pop(rid, None) is not None:
                    self.num_aborted += 1
                    self.stats.observe_aborted([rid])
            self._changed.notify_all()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _running(self) -> list[_Req]:
        return list(self.requests.values())[: self.config.scheduler.max_num_seqs]

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self._boom:
            self._boom = False
            raise RuntimeError("boom")
        time.sleep(self.step_delay)
        with self._changed:
            before = [(r, _num_tokens(r)) for r in self.requests.values()]
            results = self._step()
            grew = [r.request_id for r, n in before if _num_tokens(r) > n]
            self.stats.observe_step(time.monotonic(), len(grew), results, grew)
            self._changed.notify_all()
        return results

    def _step(self) -> list[RequestOutput]:
        now = time.monotonic()
        results = []
        for req in self._running():
            if req.pooling:
                del self.requests[req.request_id]
                ids = req.prompt_token_ids
                results.append(EmbeddingRequestOutput(
                    request_id=req.request_id, prompt=req.prompt, prompt_token_ids=ids,
                    outputs=EmbeddingOutput([float(len(ids)), float(sum(ids) % 97), 1.0]),
                    finished=True, metrics=RequestMetrics(arrival_time=req.arrival_time)))
                continue
            too_long = len(req.prompt_token_ids) > self.config.model.max_model_len
            for seq in req.outputs:
                if too_long:
                    seq.finish_reason = "length"
                elif not seq.finished:
                    self._advance(req, seq)
            req.first_token_time = req.first_token_time or now
            finished = all(o.finished for o in req.outputs)
            if finished:
                del self.requests[req.request_id]
            kind = req.params.output_kind
            if kind is RequestOutputKind.FINAL_ONLY and not finished:
                continue
            outputs = [] if too_long else [_copy(req, o, kind is RequestOutputKind.DELTA)
                                           for o in req.outputs]
            results.append(
                RequestOutput(
                    request_id=req.request_id,
                    prompt=req.prompt,
                    prompt_token_ids=req.prompt_token_ids,
                    outputs=outputs,
                    finished=finished,
                    metrics=RequestMetrics(
                        arrival_time=req.arrival_time,
                        first_scheduled_time=req.first_token_time - self.step_delay,
                        first_token_time=req.first_token_time,
                        last_token_time=now,
                        finished_time=now if finished else None,
                        num_generation_tokens=_num_tokens(req) if finished else None,
                    ),
                    error=f"prompt is too long ({len(req.prompt_token_ids)} > max_model_len "
                    f"{self.config.model.max_model_len})"
                    if too_long
                    else None,
                )
            )
        return results

    def _advance(self, req: _Req, seq: CompletionOutput) -> None:
        p = req.params
        start = len(req.prompt_token_ids) if p.is_greedy else (p.seed or 0) + seq.index
        token = ord("a") + (start + len(seq.token_ids)) % 26
        seq.token_ids.append(token)
        self.generation_tokens += 1
        if seq.logprobs is not None:
            alternatives = {ord("A") + k: -2.0 - k for k in range(p.logprobs or 0)}
            seq.logprobs.append({**alternatives, token: -0.5})
        if self.tokenizer is not None:
            seq.text += chr(token)
        for stop in p.stop:
            if stop in seq.text:
                seq.text = seq.text[: seq.text.index(stop)]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        at_max = p.max_tokens is not None and len(seq.token_ids) >= p.max_tokens
        if (
            at_max
            or len(req.prompt_token_ids) + len(seq.token_ids) >= self.config.model.max_model_len
        ):
            seq.finish_reason = "length"

    def check_constraints(self, params: SamplingParams) -> None:
        """LLMEngine's pre-admission check; the fake applies no grammar, so it only checks ids."""
        params.check_vocab(self.vocab_size)

    def get_metrics(self) -> dict[str, float]:
        running = len(self._running())
        return {
            "tessera:num_requests_running": float(running),
            "tessera:num_requests_waiting": float(len(self.requests) - running),
            "tessera:num_requests_swapped": 0.0,
            "tessera:kv_cache_usage_perc": running / 100,
            "tessera:cpu_cache_usage_perc": 0.0,
            "tessera:num_preemptions_total": 0.0,
            "tessera:prompt_tokens_total": 0.0,
            "tessera:generation_tokens_total": float(self.generation_tokens),
            "tessera:prefix_cache_hits_total": 0.0,
            "tessera:prefix_cache_queries_total": 0.0,
            "tessera:prompt_tokens_cached_total": 0.0,
        }

    def get_stats(self) -> StatsSnapshot:
        return self.stats.snapshot()

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages)


def _num_tokens(req: _Req) -> int:
    return sum(len(o.token_ids) for o in req.outputs)


def _copy(req: _Req, o: CompletionOutput, delta: bool) -> CompletionOutput:
    """All of `o` so far, or (DELTA, as the real engine's output processor) what is new."""
    chars, tokens = req.sent.get(o.index, (0, 0)) if delta else (0, 0)
    if delta:
        req.sent[o.index] = (len(o.text), len(o.token_ids))
    return CompletionOutput(index=o.index, text=o.text[chars:], token_ids=o.token_ids[tokens:],
                            logprobs=None if o.logprobs is None else o.logprobs[tokens:],
                            finish_reason=o.finish_reason, stop_reason=o.stop_reason)
