"""The `Executor` interface: the engine's only handle on the model.

Everything that crosses it is plain, picklable data (`SchedulerOutput` in, `ModelRunnerOutput` out),
so an implementation may run its workers in other processes or on other machines: the engine, the
scheduler and the API server stay where they are. Executors decide nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler_output import SchedulerOutput


class ExecutorDeadError(RuntimeError):
    """A worker process died (killed, crashed, or failed a step): the executor cannot run any
    more steps. Not a request's fault, and not recoverable by re-running requests."""


class Executor(ABC):
    # KV pool sizes the workers allocated (every worker the same), read once by the scheduler
    num_gpu_blocks: int
    num_cpu_blocks: int
    # the draft model's own KV pool (speculative decoding with a window), 0: none
    num_draft_gpu_blocks: int = 0
    # bytes of one KV block on one worker, where the executor knows it (the step log records it)
    block_bytes: int | None = None

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the sampled tokens come back from one of them.
        Raises `ExecutorDeadError` once a worker is gone."""

    def check_health(self) -> None:  # noqa: B027  (in-process executors are alive while we are)
        """Raise `ExecutorDeadError` if a worker is gone (called while the engine is idle)."""

    def shutdown(self) -> None:  # noqa: B027  (optional: in-process executors have nothing to stop)
        """Stop the workers."""
