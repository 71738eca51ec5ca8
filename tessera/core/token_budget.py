"""How the scheduler hands out one step's token budget: how many new tokens each sequence of a
group computes (a decode 1, a prefill all or, chunked, what the budget leaves), and how many of a
decode's draft tokens it verifies. Pure functions over counters: the scheduler applies what they
decide, so it stays the one writer of a sequence's progress and drafts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tessera.sequence import Sequence, SequenceGroup, SequenceStatus
from tessera.utils import cdiv

_RUNNING = SequenceStatus.RUNNING

# (sequence, tokens to compute this step) for each scheduled sequence of a group
Plan = list[tuple[Sequence, int]]


@dataclass
class Budget:
    """What is left of this step's limits while the phases hand it out."""

    tokens: int  # of max_num_batched_tokens
    num_seqs: int = 0  # seats taken, against max_num_seqs


def plan_tokens(seqs: list[Sequence], budget: int, chunked: bool, reserve: int = 0) -> Plan:
    """Tokens for each sequence this step: a decode takes 1; a prefill takes all it needs, or
    with chunked prefill as much as the budget minus `reserve` (decodes still to come) gives."""
    plan = []
    for seq in seqs:
        need = seq.get_num_uncomputed_tokens()
        if need <= 0:
            continue
        if need == 1:
            take = 1 if budget >= 1 else 0
        elif chunked:
            take = min(need, budget - reserve)
        else:
            take = need if need <= budget else 0
        if take > 0:
            plan.append((seq, take))
            budget -= take
    return plan


def take_drafts(
    plan: Plan, room: int, spare_blocks: int, max_model_len: int, max_tokens: int | None,
    block_size: int, num_logical_blocks: Callable[[Sequence], int],
) -> tuple[Plan, dict[int, int]]:
    """Schedule the draft tokens of the plan's decodes as extra new tokens, within `room`
    tokens of budget and `spare_blocks` new blocks, and so that verification can neither pass
    `max_tokens` nor `max_model_len`. Returns the plan with them and, per decoding sequence
    (seq_id), how many of its drafts it verifies: the scheduler trims each running sequence's
    `spec_token_ids` to that (the block manager reserves lookahead slots for exactly those);
    sequences not decoding this step verify none. `num_logical_blocks`: the table's token
    blocks (`BlockManager.get_num_logical_blocks`)."""
    bs = block_size
    taken: Plan = []
    num_verified: dict[int, int] = {}
    for seq, n in plan:
        drafts = seq.spec_token_ids
        if n == 1 and drafts and seq.is_decoding():
            num_tokens = seq.get_len()
            # slots already in the table (or in the block its next token needs) are free to use
            have = max(num_logical_blocks(seq), cdiv(num_tokens, bs)) * bs
            k = min(len(drafts), max(room, 0), max_model_len - num_tokens - 1,
                    have - num_tokens + max(spare_blocks, 0) * bs)
            if max_tokens is not None:
                k = min(k, max_tokens - seq.get_output_len() - 1)
            k = max(k, 0)
            spare_blocks -= cdiv(max(num_tokens + k - have, 0), bs)
            room -= k
            n += k
            num_verified[seq.seq_id] = k
        taken.append((seq, n))
    return taken, num_verified


def any_drafts(seqs: list[Sequence]) -> bool:
    return any(s.spec_token_ids for s in seqs)


def num_decodes(group: SequenceGroup) -> int:
    """The group's running sequences that decode (one new token each) this step."""
    seqs = group.seqs
    if len(seqs) == 1:  # the common case, once per running group per step: no generator
        seq = seqs[0]
        return 1 if seq.status is _RUNNING and seq.is_decoding() else 0
    return sum(1 for s in seqs if s.status is _RUNNING and s.is_decoding())
