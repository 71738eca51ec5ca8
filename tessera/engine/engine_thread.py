"""The one thread that owns the engine: it builds the model and then steps it.

Why the thread that steps must also build: torch's CPU ops run their parallel regions on libgomp,
which keeps one pool of worker threads for each thread that enters such a region. Once the main
thread has loaded the model (its pool exists and stays) and another thread steps it (a second
pool), libgomp manages more threads than there are CPUs, and then its workers sleep between
parallel regions instead of spinning: every op of a step pays a futex wake-up. Measured on the
2-core machine: 200 greedy decode steps at batch 1 (bf16, `LLM.generate`) took 0.86 s on the
thread that loaded the model and 2.23 s on a thread started after it; `tessera serve` at low load
ran a median TPOT of 11.5 ms against a runner step of ~4 ms.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread that runs what it is given, in order: `call` jobs (the caller waits for
    their result), then one `run` job, after which the thread ends."""

    def __init__(self, name: str = "tessera-engine") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on this thread; its result, or its exception raised here."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, done))
        return done.result()

    def run(self, fn: Callable[[], None]) -> None:
        """Hand this thread its last job and return at once; the thread ends when `fn` does."""
        self._jobs.put((fn, (), None))

    def _work(self) -> None:
        while True:
            fn, args, done = self._jobs.get()
            if done is None:
                fn()
                return
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, which re-raises it
                done.set_exception(e)
