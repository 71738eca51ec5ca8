"""Request state: `Sequence` (one stream of tokens) and `SequenceGroup` (one request: n sequences
that share a prompt). Knows nothing of blocks or tensors. Only the scheduler writes them (it moves
them between queues and appends to them), and `status` and `num_computed_tokens` only through
`set_progress` (tessera/core/progress.py); the runner and the engine see plain messages instead.

Every sequence carries `num_computed_tokens`: how many of its tokens already have KV in the cache.
A step hands it `num_new_tokens` more. That one counter covers prefill, chunked prefill, decode,
prefix-cache hits (which start it above zero) and recompute (which resets it to zero).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tessera.utils import token_range

if TYPE_CHECKING:
    from tessera.lora.request import LoRARequest
    from tessera.pooling_params import PoolingParams
    from tessera.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    # holds its blocks while a peer's KV for its prompt arrives (disaggregated prefill/decode)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
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


def is_decode(num_new_tokens: int, num_computed_tokens: int) -> bool:
    """A decode: one new token after a cached context. The one home of this rule: the scheduler
    reserves budget for decodes before prompt chunks, the runner puts them first in its batch, and
    attention takes its decode path for them."""
    return num_new_tokens == 1 and num_computed_tokens > 0


_seq_ids = itertools.count()


def new_seq_id() -> int:
    """A process-wide unique sequence id (block tables are keyed by it)."""
    return next(_seq_ids)


@dataclass
class Sequence:
    """One stream of tokens. Its progress (`num_computed_tokens`, appended tokens, `status`) is
    written only by the scheduler: `status` and `num_computed_tokens` through `set_progress`
    (core/progress.py: admission, remote KV, a step's update, preemption, finish). Text, logprobs
    and stop strings are the engine's
    `OutputProcessor`'s."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    stop_reason: int | str | None = None
    # the key of this stream in messages to the runner (set by its SequenceGroup)
    req_id: str = ""
    index: int = 0  # position in its group: 0 is the first, k the k-th forked child
    # draft tokens the runner proposed after this sequence's last token (speculative decoding):
    # set by `update_from_output`, trimmed by `schedule()` to what the step verifies (the block
    # manager reserves lookahead slots for exactly these), dropped on preemption
    spec_token_ids: list[int] = field(default_factory=list)
    # the LoRA adapter it runs under (0: the base model), set by its SequenceGroup: its KV, and
    # so its prefix-cache keys, are the adapter's own
    lora_int_id: int = 0

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids_range(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole prompt + output list."""
        return token_range(self.prompt_token_ids, self.output_token_ids, start, end)

    def get_num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not yet in the cache: the rest of the prompt in prefill, 1 in decode
        (before speculative tokens). The one home of "tokens still to compute"."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    def is_decoding(self) -> bool:
        """`is_decode` of this sequence's next step (before speculative tokens)."""
        computed = self.num_computed_tokens
        num_new = len(self.prompt_token_ids) + len(self.output_token_ids) - computed
        return is_decode(num_new, computed)

    def is_finished(self) -> bool:
        return self.status.is_finished

    def fork(self, new_seq_id: int, index: int, req_id: str) -> Sequence:
        """A child sharing everything so far; the block manager shares its blocks by ref count."""
        return Sequence(
            seq_id=new_seq_id,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.output_token_ids),
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            req_id=req_id,
            index=index,
            lora_int_id=self.lora_int_id,
        )


@dataclass
class SequenceGroup:
    """One request. It starts with a single sequence; when its prompt is done and `n > 1`, the
    scheduler forks the other n-1 from it (sharing the prompt's blocks), so the prompt is computed
    once. Until then the group holds seats for all n (`is_fork_pending`)."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    prompt: str | None = None
    # latency bookkeeping (engine clock), written by the scheduler
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # why the group was ignored at admission, if it was
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    # its peer's KV was pulled once (or failed): after a recompute it prefills here
    remote_kv_tried: bool = False
    # an embedding request (prefill-only): pooled instead of sampled, finished with its prompt
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under; None: the base model

    def __post_init__(self) -> None:
        for seq in self.seqs:
            seq.lora_int_id = self.lora_int_id
        for i, seq in enumerate(self.seqs):
            if not seq.req_id:
                seq.req_id = child_req_id(self.request_id, i)
                seq.index = i

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished()]

    @property
    def is_fork_pending(self) -> bool:
        """n > 1 and the first token not yet sampled: the step that completes the prompt samples
        n tokens and the scheduler forks n-1 children. The one home of this rule."""
        n = self.sampling_params.n
        return n > 1 and len(self.seqs) < n and not self.seqs[0].output_token_ids

    def max_num_running_seqs(self) -> int:
        """Sequences this group may run at once: n before the fork (seats for the children)."""
        if self.is_fork_pending:
            return self.sampling_params.n
        return len(self.get_unfinished_seqs())

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs)


def child_req_id(request_id: str, index: int) -> str:
    """The runner-facing id of a group's `index`-th stream (vLLM's naming for parallel samples)."""
    return request_id if index == 0 else f"{index}_{request_id}"
