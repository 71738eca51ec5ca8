"""Which requests a step may admit under --max-loras: at most `max_loras` distinct LoRA adapters
among the running requests (so in any step, whose requests are all running), as vLLM limits them.

The rule, per step, over the running groups' adapters (`begin`):
- the base model (adapter 0) needs no slot and is never held back;
- a request whose adapter already runs joins it, unless that adapter is draining (below);
- a request of another adapter joins if a slot is free; else it waits, and keeps its place
  (the scheduler puts skipped requests back at the front, in order), while younger requests of
  running adapters may pass it.
No starvation: when a request waits for a slot, one running adapter is chosen to drain (the one
with the fewest running requests, so it frees soonest) and admits nobody new until the waiting
request got its slot. Every request ends, so the drained adapter's slot frees, and the oldest
waiting request takes it. With --max-loras 1 this is plain FCFS over adapters.

Pure Python (core/): counts come from one walk of `running`, which the step walks anyway.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tessera.sequence import SequenceGroup


class LoRAAdmission:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._running: Counter[int] = Counter()  # adapter id -> running groups (this step)
        self._draining: int | None = None  # admits nobody new while an older request waits
        self._held: set[int] = set()  # adapters of requests held back this step

    def begin(self, running: Iterable[SequenceGroup]) -> None:
        """Start a step's admissions from the groups running now."""
        self._running = Counter(g.lora_int_id for g in running if g.lora_int_id)
        self._held = set()
        if self._draining not in self._running:
            self._draining = None

    def may_run(self, group: SequenceGroup) -> bool:
        lid = group.lora_int_id
        if lid == 0:
            return True
        if lid in self._running:
            return lid != self._draining
        return lid not in self._held and len(self._running) < self.max_loras

    def admitted(self, group: SequenceGroup) -> None:
        if group.lora_int_id:
            self._running[group.lora_int_id] += 1

    def held(self, group: SequenceGroup) -> None:
        """`group` waits for a slot: pick an adapter to drain if none is draining."""
        lid = group.lora_int_id
        self._held.add(lid)
        if lid in self._running or self._draining is not None or not self._running:
            return
        self._draining = min(self._running, key=lambda a: (self._running[a], a))

    def end(self) -> None:
        """After a step's admissions: when only the draining adapter's own requests were held
        back (nobody waits for a slot), it drains no more."""
        if not self._held - {self._draining}:
            self._draining = None

    @property
    def running_adapters(self) -> set[int]:
        return set(self._running)
