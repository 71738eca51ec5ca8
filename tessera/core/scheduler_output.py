"""What the scheduler decides for one step: the message from `core/` to the model runner.

Plain Python (no tensors): the runner turns it into flat tensors, the cache engine applies the
block mappings before the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.sequence import Sequence, SequenceGroup


@dataclass
class ScheduledSequence:
    """One sequence's share of the step: compute KV for `token_ids[num_computed_tokens :
    num_computed_tokens + num_new_tokens]`, writing into `block_table`."""

    seq: Sequence
    num_new_tokens: int
    block_table: list[int]
    # the sequence's num_computed_tokens when scheduled (the first position of this step's tokens);
    # kept so that `do_sample` stays right after `Scheduler.update_after_step` advances the sequence
    num_computed_tokens: int | None = None

    @property
    def do_sample(self) -> bool:
        """Sample after this step iff it brings the sequence's KV up to its full length."""
        start = self.num_computed_tokens
        if start is None:
            start = self.seq.num_computed_tokens
        return start + self.num_new_tokens == self.seq.get_len()


@dataclass
class ScheduledSequenceGroup:
    group: SequenceGroup
    # one entry per running sequence of the group scheduled this step
    seqs: list[ScheduledSequence]

    @property
    def num_new_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


@dataclass
class SchedulerOutput:
    scheduled_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    # {src_block: dst_block}: CPU -> device, device -> CPU; (src, dst) device copies for copy-on-write
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted_groups: list[SequenceGroup] = field(default_factory=list)
    # rejected at admission (can never fit); their sequences are FINISHED_IGNORED with group.error
    ignored_groups: list[SequenceGroup] = field(default_factory=list)
    # counters for this step
    num_preemptions: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_prefix_cache_hit_tokens: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(g.num_new_tokens for g in self.scheduled_groups)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_groups and not (
            self.blocks_to_swap_in or self.blocks_to_swap_out or self.blocks_to_copy
        )
