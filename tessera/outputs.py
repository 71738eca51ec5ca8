"""What the engine hands back for each request after a step (vLLM's `RequestOutput` shape).

What `text`, `token_ids` and `logprobs` hold follows `SamplingParams.output_kind`: everything so
far (CUMULATIVE, the default), only what is new since the previous output (DELTA: what a stream
sends), or everything, once, at the end (FINAL_ONLY: what `LLM.generate` returns).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # per generated token: {token_id: logprob} holding the chosen token and the top-k alternatives
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Engine-clock timestamps (seconds) for latency histograms, and on the final output the
    request's generated-token count (summed over its n sequences; a DELTA output's own
    token_ids hold only the last few)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # [prompt_len] entries, None for the first token; set only when prompt_logprobs was asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # why the request was rejected (e.g. prompt longer than max_model_len); outputs are then empty
    error: str | None = None
    # the engine failed while running this request (error says so): not the client's mistake.
    # Only this request was stopped; the others in its step went on (engine/step_recovery.py)
    failed: bool = False
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    # on a KV producer's final output: the params a consumer pulls this request's KV with
    kv_transfer_params: dict | None = None


@dataclass
class EmbeddingOutput:
    """One prompt's pooled vector (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What an embedding request (`LLM.embed`, `/v1/embeddings`) finishes with: vLLM's shape,
    `.outputs.embedding`. It comes once, finished; `outputs` is None when the request was
    rejected (`error` says why) or failed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    failed: bool = False
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    kv_transfer_params: dict | None = None  # never set: an embedding's KV is not moved
