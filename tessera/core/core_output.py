"""What `Scheduler.update_from_output` hands the engine's `OutputProcessor` after a step: per
request, the tokens each of its sequences gained and how they ended. Plain data, like every message
between parts; the processor turns it into text and `RequestOutput`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.outputs import RequestMetrics


@dataclass(slots=True)
class SeqDelta:
    index: int  # the sequence's place in its request (0, or the k-th forked child)
    new_token_ids: list[int]
    # per new token: {token_id: logprob}, the chosen token included (see ModelRunnerOutput);
    # empty when the runner reported none
    new_logprobs: list[dict[int, float]]
    finish_reason: str | None = None  # "stop", "length", "abort" once the sequence is done
    stop_reason: int | str | None = None  # the stop token id that ended it (None for EOS)


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    seqs: list[SeqDelta] = field(default_factory=list)  # the sequences that changed this step
    # (position of the first scored prompt token, {token_id: logprob} per position), a chunk
    prompt_logprobs: tuple[int, list[dict[int, float]]] | None = None
    finished: bool = False
    error: str | None = None  # why it was rejected at admission (never fits)
    # the request's timestamps, sent when its first token arrives and when it finishes
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # a producer's finished request: where a consumer pulls its KV from (disaggregation)
    kv_transfer_params: dict[str, object] | None = None
    # an embedding request's pooled vector, with `finished` (its prompt is all it computes)
    pooler_output: list[float] | None = None
