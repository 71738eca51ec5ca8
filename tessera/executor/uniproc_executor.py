"""`UniProcExecutor`: the model runner in the engine's own process and thread (the default; with
`--tensor-parallel-size` > 1 `MultiprocExecutor` runs one runner per rank instead)."""

from __future__ import annotations

from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler_output import SchedulerOutput
from tessera.executor.abstract import Executor
from tessera.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.num_gpu_blocks = runner.cache_engine.num_gpu_blocks
        self.num_cpu_blocks = runner.cache_engine.num_cpu_blocks
        draft = runner.draft_proposer
        if draft is not None and draft.own_pool_base is not None:
            self.num_draft_gpu_blocks = draft.cache.num_gpu_blocks
        self.block_bytes = runner.cache_engine.spec.block_bytes

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.runner.kv_connector is not None:  # its sockets and threads
            self.runner.kv_connector.shutdown()
