"""Where the model runners live: `UniProcExecutor` runs one in this process; a multiprocess
executor (one worker per tensor-parallel rank) implements the same `Executor` interface with the
same messages."""

from tessera.executor.abstract import Executor
from tessera.executor.uniproc_executor import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
