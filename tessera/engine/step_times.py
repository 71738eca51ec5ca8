"""Where the engine's time goes, summed over its steps: what benchmarks and profiles read
(`LLMEngine.step_times`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTimes:
    """Where the engine's time goes, summed over steps (seconds): for benchmarks and profiling."""

    num_steps: int = 0
    num_tokens: int = 0
    schedule: float = 0.0
    execute: float = 0.0
    update: float = 0.0
    # the steps that computed more tokens than they scheduled requests (prompt tokens, or
    # speculative drafts) and their execute time: a workload's prefill against its decode
    num_multi_token_steps: int = 0
    multi_token_execute: float = 0.0

    def record(self, schedule: float, execute: float, update: float, num_tokens: int,
               num_reqs: int = 0) -> None:
        self.num_steps += 1
        self.num_tokens += num_tokens
        self.schedule += schedule
        self.execute += execute
        self.update += update
        if num_tokens > num_reqs:
            self.num_multi_token_steps += 1
            self.multi_token_execute += execute
