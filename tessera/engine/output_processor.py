"""`OutputProcessor`: the engine-side half of a request's output. It owns what needs text: the
incremental detokenizer, stop strings, logprob lists and the `RequestOutput`s a caller sees.

The scheduler reports token ids (`EngineCoreOutput`); this turns them into text. A stop string
is found here, and the request is finished through the scheduler: `process` returns the matches,
the engine hands them to `Scheduler.finish_seqs`.

Streaming without leaking a stop string: text that could still turn out to be the start of a stop
string is held back (its last `max(len(stop)) - 1` characters) until the next token decides, so
every output, delta or cumulative, is a prefix of the final text, and a stream concatenates to
exactly the non-streamed answer. With `include_stop_str_in_output` nothing need be held back:
text before the end of a match is output anyway.

Output kinds (`SamplingParams.output_kind`): CUMULATIVE copies everything so far (O(length) per
output); DELTA carries only what is new since the last output (what the server streams);
FINAL_ONLY emits once, when the request finishes (what `LLM.generate` uses).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tessera.core.core_output import EngineCoreOutput, SeqDelta
from tessera.engine.detokenizer import DetokState, IncrementalDetokenizer
from tessera.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from tessera.sampling.params import RequestOutputKind, SamplingParams

_DELTA = RequestOutputKind.DELTA
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@dataclass
class SeqOutputState:
    """One sequence's output as the caller sees it (what `IncrementalDetokenizer` updates)."""

    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    detok_state: DetokState | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # what earlier DELTA outputs carried
    num_sent_tokens: int = 0
    num_sent_chars: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[SeqOutputState] = field(default_factory=lambda: [SeqOutputState()])
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    pooling: bool = False  # an embedding request: one output, its vector, when it finishes
    # characters of text held back while a stop string may still be completing; set once, since
    # it is read for every request every step
    holdback: int = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.holdback = 0 if p.include_stop_str_in_output else max(0, p.max_stop_str_len - 1)


class OutputProcessor:
    def __init__(self, tokenizer, clock: Callable[[], float]) -> None:
        # no tokenizer (a bare HF checkpoint): token ids in, token ids out, no text
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.clock = clock
        self.requests: dict[str, RequestState] = {}

    def add_request(self, state: RequestState) -> None:
        self.requests[state.request_id] = state

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def process(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput | EmbeddingRequestOutput], list[tuple[str, int, str]]]:
        """Detokenize, check stop strings and build outputs. Returns the outputs and the stop
        string matches (request id, sequence index, string) the scheduler must finish."""
        outputs: list[RequestOutput | EmbeddingRequestOutput] = []
        stops: list[tuple[str, int, str]] = []
        for core in core_outputs:
            req = self.requests.get(core.request_id)
            if req is None:
                continue  # aborted meanwhile
            req.metrics = core.metrics or req.metrics
            req.num_cached_tokens = core.num_cached_tokens
            if req.pooling:
                if core.finished:
                    del self.requests[req.request_id]
                    outputs.append(_embedding_output(req, core))
                continue
            if core.prompt_logprobs is not None:
                _extend_prompt_logprobs(req, *core.prompt_logprobs)
            for delta in core.seqs:
                while len(req.seqs) <= delta.index:  # a child forked this step
                    req.seqs.append(SeqOutputState())
                seq = req.seqs[delta.index]
                stop_str = self._update_seq(req, seq, delta)
                if stop_str is not None:
                    stops.append((req.request_id, delta.index, stop_str))
            finished = core.finished or (
                len(req.seqs) == req.params.n and all(s.finish_reason for s in req.seqs)
            )
            if finished:
                del self.requests[req.request_id]
                if req.metrics is not None:
                    end = req.metrics.finished_time
                    req.metrics = replace(
                        req.metrics, finished_time=self.clock() if end is None else end,
                        num_generation_tokens=sum(len(s.output_token_ids) for s in req.seqs),
                    )
            output = self._make_output(req, core, finished)
            if output is not None:
                outputs.append(output)
        return outputs, stops

    def _update_seq(self, req: RequestState, seq: SeqOutputState, delta: SeqDelta) -> str | None:
        """Append the new tokens and their text; returns a stop string that matched."""
        params = req.params
        last = len(delta.new_token_ids) - 1
        stopped_by_token = delta.finish_reason == "stop"
        logprobs = delta.new_logprobs
        for i, token_id in enumerate(delta.new_token_ids):
            seq.output_token_ids.append(token_id)
            if logprobs:
                lps = logprobs[i]
                seq.logprobs.append(lps)
                seq.cumulative_logprob += lps.get(token_id, 0.0)
            if self.detokenizer is None:
                continue
            new_text = self.detokenizer.decode_new(seq, params.skip_special_tokens)
            if i == last and stopped_by_token:
                if new_text and not params.include_stop_str_in_output:
                    seq.output_text = seq.output_text[: -len(new_text)]
                continue
            if params.stop and new_text and len(seq.output_token_ids) >= params.min_tokens:
                stop_str = self._check_stop_strings(seq, params, len(new_text))
                if stop_str is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop_str
                    return stop_str
        if delta.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
        return None

    @staticmethod
    def _check_stop_strings(
        seq: SeqOutputState, params: SamplingParams, num_new: int
    ) -> str | None:
        """Find the earliest stop string overlapping the new text and cut the text there."""
        # older text was searched in earlier steps, so each string is looked for in the new tail
        # plus len(stop_str) - 1 characters before it
        tail_start = len(seq.output_text) - num_new
        best: tuple[int, str] | None = None  # earliest match wins; on a tie, the list's order
        for stop_str in params.stop:
            at = seq.output_text.find(stop_str, max(0, tail_start - len(stop_str) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop_str)
        if best is None:
            return None
        at, stop_str = best
        end = at + len(stop_str) if params.include_stop_str_in_output else at
        seq.output_text = seq.output_text[:end]
        return stop_str

    def _make_output(
        self, req: RequestState, core: EngineCoreOutput, finished: bool
    ) -> RequestOutput | None:
        kind = req.params.output_kind
        if kind is _FINAL_ONLY and not finished:
            return None
        completions = []
        if core.error is None:
            holdback = 0 if finished else req.holdback
            for i, seq in enumerate(req.seqs):
                done = seq.finish_reason is not None
                visible = len(seq.output_text) - (0 if done else holdback)
                if kind is _DELTA:
                    start_chars = seq.num_sent_chars
                    visible = max(visible, start_chars)
                    if visible == start_chars and len(seq.output_token_ids) == seq.num_sent_tokens:
                        continue  # nothing new for this sequence (a finishing one has a token)
                    start_tokens = seq.num_sent_tokens
                    seq.num_sent_chars, seq.num_sent_tokens = visible, len(seq.output_token_ids)
                else:
                    start_chars = start_tokens = 0
                    visible = max(visible, 0)
                completions.append(
                    CompletionOutput(
                        index=i,
                        text=seq.output_text[start_chars:visible],
                        token_ids=seq.output_token_ids[start_tokens:],
                        cumulative_logprob=seq.cumulative_logprob,
                        logprobs=seq.logprobs[start_tokens:]
                        if req.params.logprobs is not None
                        else None,
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                    )
                )
            if kind is _DELTA and not completions and not finished:
                return None
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=req.metrics or RequestMetrics(arrival_time=req.arrival_time),
            prompt_logprobs=req.prompt_logprobs,
            error=core.error,
            num_cached_tokens=req.num_cached_tokens,
            kv_transfer_params=core.kv_transfer_params if finished else None,
        )


def _embedding_output(req: RequestState, core: EngineCoreOutput) -> EmbeddingRequestOutput:
    vector = core.pooler_output
    return EmbeddingRequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
        outputs=None if vector is None else EmbeddingOutput(vector), finished=True,
        metrics=req.metrics or RequestMetrics(arrival_time=req.arrival_time),
        error=core.error, num_cached_tokens=req.num_cached_tokens)


def _extend_prompt_logprobs(
    req: RequestState, first_pos: int, chunk: list[dict[int, float]]
) -> None:
    """Extend with this chunk's prompt logprobs (once: a recompute scores the prompt again)."""
    if req.prompt_logprobs is None:
        req.prompt_logprobs = [None]  # the first prompt token has no logprob
    if len(req.prompt_logprobs) == first_pos:
        req.prompt_logprobs.extend(chunk)
