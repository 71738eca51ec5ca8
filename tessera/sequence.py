"""Request state: `Sequence` (one stream of tokens) and `SequenceGroup` (one request: n sequences
that share a prompt). Knows nothing of blocks or tensors; the scheduler and engine move these
objects between queues and append to them.

Every sequence carries `num_computed_tokens`: how many of its tokens already have KV in the cache.
A step hands it `num_new_tokens` more. That one counter covers prefill, chunked prefill, decode,
prefix-cache hits (which start it above zero) and recompute (which resets it to zero).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tessera.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_IGNORED = "ignored"  # rejected at admission: could never fit

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status (an ignored request reports `length`)."""
        if self is SequenceStatus.FINISHED_IGNORED:
            return "length"
        return self.value if self.is_finished else None


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH_CAPPED,
    SequenceStatus.FINISHED_ABORTED,
    SequenceStatus.FINISHED_IGNORED,
}


@dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # per generated token: logprob of the chosen token and {token_id: logprob} of the top ones
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # detokenizer state (owned by the engine's detokenizer)
    output_text: str = ""
    detok_state: Any = None
    stop_reason: int | str | None = None

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids_range(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole prompt + output list (per-step path)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_new_tokens(self) -> int:
        """Tokens whose KV is not yet in the cache (1 for a decode, the rest of the prompt in prefill)."""
        return self.get_len() - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_new_tokens > 1 or not self.output_token_ids

    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.get(token_id, 0.0)

    def reset_for_recompute(self) -> None:
        """KV was dropped: the whole sequence (prompt + output so far) must be prefilled again."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def fork(self, new_seq_id: int) -> Sequence:
        """A child sharing everything so far; the block manager shares its blocks by ref count."""
        return Sequence(
            seq_id=new_seq_id,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.output_token_ids),
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            output_logprobs=list(self.output_logprobs),
            cumulative_logprob=self.cumulative_logprob,
            output_text=self.output_text,
            detok_state=self.detok_state,
        )


@dataclass
class SequenceGroup:
    """One request. It starts with a single sequence; when its prompt is done and `n > 1`, the engine
    forks the other n-1 from it (sharing the prompt's blocks), so the prompt is computed once."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    prompt: str | None = None
    # latency bookkeeping (engine clock)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # why the group was ignored at admission, if it was
    error: str | None = None
    # prompt logprobs, filled by the engine when sampling_params.prompt_logprobs is set
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status is status]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        if status is None:
            return len(self.seqs)
        return sum(1 for s in self.seqs if s.status is status)

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished()]

    def max_num_running_seqs(self) -> int:
        """Sequences this group may run at once: n before the fork (reserve for the children)."""
        n = getattr(self.sampling_params, "n", 1)
        if len(self.seqs) < n and not self.seqs[0].output_token_ids:
            return n
        return len(self.get_unfinished_seqs())

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs)

    def is_prefill(self) -> bool:
        return any(s.num_new_tokens > 1 for s in self.get_unfinished_seqs())
