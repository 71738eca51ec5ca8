"""Stop conditions: after a token is appended and detokenised, decide whether its sequence is done.

`StopChecker.check` runs in this order (vLLM's) and stops at the first rule that fires:

1. fewer than `min_tokens` outputs: only the length caps (5, 6) may end the sequence;
2. EOS (any of the model's EOS ids) unless `ignore_eos` -> FINISHED_STOPPED, stop_reason None
   (OpenAI reports a natural end as stop_reason None);
3. a `stop_token_ids` token -> FINISHED_STOPPED, stop_reason = that id;
4. a stop string in the newly detokenised text -> FINISHED_STOPPED, stop_reason = the string;
   the output text is cut at the match (or just after it with `include_stop_str_in_output`);
5. `max_tokens` outputs -> FINISHED_LENGTH_CAPPED;
6. `seq.get_len() >= max_model_len` -> FINISHED_LENGTH_CAPPED.

For 2 and 3 the stop token's own text (if the detokenizer rendered it, e.g. with
skip_special_tokens=False) is removed from the output text unless `include_stop_str_in_output`.
The token id itself stays in `output_token_ids`.
"""

from __future__ import annotations

from tessera.sampling.params import SamplingParams
from tessera.sequence import Sequence, SequenceStatus


class StopChecker:
    def __init__(self, max_model_len: int, eos_token_ids: tuple[int, ...]) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)

    def check(self, seq: Sequence, params: SamplingParams, new_char_count: int) -> None:
        """Set seq.status (and seq.stop_reason, seq.output_text) if seq must stop now.

        `new_char_count` is the length of the text the detokenizer just appended for this step.
        """
        output_len = seq.get_output_len()
        if output_len >= params.min_tokens and self._check_stop(seq, params, new_char_count):
            return
        if (params.max_tokens is not None and output_len >= params.max_tokens
                or seq.get_len() >= self.max_model_len):
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    def _check_stop(self, seq: Sequence, params: SamplingParams, new_char_count: int) -> bool:
        last = seq.get_last_token_id()
        is_eos = not params.ignore_eos and last in self.eos_token_ids
        if is_eos or last in params.stop_token_ids:
            if new_char_count and not params.include_stop_str_in_output:
                seq.output_text = seq.output_text[:-new_char_count]
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = None if is_eos else last
            return True
        if not params.stop or not new_char_count:
            return False
        # A match must overlap the new text (older text was searched in earlier steps), so each
        # string is searched for in the new tail plus len(stop_str) - 1 chars before it.
        tail_start = len(seq.output_text) - new_char_count
        best: tuple[int, str] | None = None  # earliest match wins; on a tie, the list's order
        for stop_str in params.stop:
            at = seq.output_text.find(stop_str, max(0, tail_start - len(stop_str) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop_str)
        if best is None:
            return False
        at, stop_str = best
        end = at + len(stop_str) if params.include_stop_str_in_output else at
        seq.output_text = seq.output_text[:end]
        seq.status = SequenceStatus.FINISHED_STOPPED
        seq.stop_reason = stop_str
        return True
