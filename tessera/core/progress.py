"""`set_progress`: the one writer of a sequence's `status` and `num_computed_tokens`.

Every change of either goes through this function, and only the scheduler calls it
(tests/core/test_single_writer.py fails on any other assignment). Other parts report what
happened and the scheduler applies it:

    event                          status                       num_computed_tokens
    admission (schedule)           WAITING -> RUNNING           the prefix-cache hit tokens,
                                                                returned by BlockManager.allocate
    parked for a peer's KV         -> WAITING_FOR_REMOTE_KVS    kept
    the peer's KV landed / failed  -> RUNNING                   prompt - 1 / kept (local prefill)
    a step (update_from_output)    kept, or FINISHED_* when     + the tokens computed and accepted
                                   check_token_stop says so
    swap out / swap in             RUNNING <-> SWAPPED          kept
    recompute                      -> WAITING                   0
    abort, stop string, rejection  -> FINISHED_*                kept

The runner keeps its own copy of `num_computed_tokens` (tessera/worker/input_batch.py), set only
from the scheduler's messages.
"""

from __future__ import annotations

from tessera.sequence import Sequence, SequenceStatus


def set_progress(seq: Sequence, num_computed_tokens: int, status: SequenceStatus) -> None:
    """Move `seq` to `status` with `num_computed_tokens` of its tokens' KV in the cache (after a
    verification step this counts accepted draft positions whose tokens are appended next)."""
    assert num_computed_tokens >= 0, f"{seq.req_id}: num_computed_tokens {num_computed_tokens}"
    seq.num_computed_tokens = num_computed_tokens
    seq.status = status
