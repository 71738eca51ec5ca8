"""The stop rules that need only token ids, applied by `Scheduler.update_from_output` after each
appended token, in this order (vLLM's); the first that fires ends the sequence:

1. fewer than `min_tokens` outputs: only the length caps (4, 5) may end it;
2. EOS (any of the model's EOS ids) unless `ignore_eos` -> FINISHED_STOPPED, stop_reason None
   (OpenAI reports a natural end as stop_reason None);
3. a `stop_token_ids` token -> FINISHED_STOPPED, stop_reason = that id;
4. `max_tokens` outputs -> FINISHED_LENGTH_CAPPED;
5. `get_len() >= max_model_len` -> FINISHED_LENGTH_CAPPED.

Stop strings need text, so the engine's `OutputProcessor` checks them after detokenising and
finishes the sequence through the scheduler (`Scheduler.finish_seqs`). The stop token id itself
stays in `output_token_ids`.
"""

from __future__ import annotations

from tessera.sampling.params import SamplingParams
from tessera.sequence import Sequence, SequenceStatus


def check_token_stop(
    seq: Sequence, params: SamplingParams, max_model_len: int, eos_token_ids: tuple[int, ...]
) -> SequenceStatus | None:
    """The finished status if `seq`'s newest token ends it (setting `seq.stop_reason` for a stop
    token), else None. The scheduler applies the status (core/progress.py)."""
    output_len = len(seq.output_token_ids)
    if output_len >= params.min_tokens:
        last = seq.output_token_ids[-1]
        is_eos = not params.ignore_eos and last in eos_token_ids
        if is_eos or last in params.stop_token_ids:
            seq.stop_reason = None if is_eos else last
            return SequenceStatus.FINISHED_STOPPED
    if (params.max_tokens is not None and output_len >= params.max_tokens) or (
        seq.get_len() >= max_model_len
    ):
        return SequenceStatus.FINISHED_LENGTH_CAPPED
    return None
