"""Why a request can never run: checked when it reaches the head of the waiting queue, so that it is
rejected at once with a reason instead of waiting forever."""

from __future__ import annotations

from tessera.config import SchedulerConfig
from tessera.core.block_manager import BlockManager
from tessera.sequence import SequenceGroup, SequenceStatus


def reject_reason(group: SequenceGroup, cfg: SchedulerConfig) -> str | None:
    """A limit of the configuration the request exceeds, or None."""
    for seq in group.seqs:
        if not seq.is_finished() and seq.get_len() > cfg.max_model_len:
            if seq.get_output_len():
                return (
                    f"sequence has {seq.get_len()} tokens (prompt + output), more than "
                    f"max_model_len {cfg.max_model_len}"
                )
            return f"prompt has {seq.get_len()} tokens, more than max_model_len {cfg.max_model_len}"
    n = group.max_num_running_seqs()
    if n > cfg.max_num_seqs:
        return f"request needs {n} sequences at once, more than max_num_seqs {cfg.max_num_seqs}"
    if n > cfg.max_num_batched_tokens:
        return (
            f"request needs {n} sequences at once, more than max_num_batched_tokens "
            f"{cfg.max_num_batched_tokens}"
        )
    return None


def never_fits_reason(group: SequenceGroup, bm: BlockManager) -> str:
    """The message for a request whose blocks exceed even an empty device pool."""
    num_tokens = sum(s.get_len() for s in group.seqs if s.status is SequenceStatus.WAITING)
    return (
        f"request needs {bm.num_required_blocks(group)} KV blocks ({num_tokens} tokens, block "
        f"size {bm.block_size}), more than the {bm.num_gpu_blocks} device blocks less the "
        f"watermark of {bm.watermark_blocks}"
    )
