"""`AsyncLLMEngine`: the synchronous `LLMEngine` driven from a background thread for asyncio
callers.

Why a thread and not a process: the model's work happens inside torch ops, which release the GIL,
so the HTTP event loop keeps answering (`/health` stays fast under a full batch) while outputs
cross over without pickling. The engine is not thread-safe, so the rule is:

    event loop ──(commands: add / abort / abort-all, a thread-safe queue)──▶ engine thread
    engine thread ──(loop.call_soon_threadsafe(list of RequestOutput))──▶ per-request asyncio.Queue

Only the engine thread touches the `LLMEngine`, and `from_engine_args` builds it on that same
thread (tessera/engine/engine_thread.py: torch's thread pools run 2.6x slower on a thread other
than the one that loaded the model). When it has no work it sleeps on a
`threading.Event` (set by every command), so an idle server burns no CPU (it wakes once a
second to ask the executor whether its worker processes still live).

Failures: a step that fails because of one request fails only that request (the engine finds it,
tessera/engine/step_recovery.py; its stream gets `EngineError`). Should `engine.step()` itself
raise (a bug outside the forward pass), the requests in flight fail with `EngineError` and the
loop keeps serving. Error messages name what failed, never the internal exception's text (that
goes to the log). A dead executor (a tensor-parallel worker killed or crashed,
`ExecutorDeadError`) is the exception: nothing can run any more, so the requests in flight fail
with its message, the loop stops, and `on_fatal` callbacks run (the server exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tessera.engine.engine_thread import EngineThread
from tessera.engine.malloc_tuning import release_free_memory
from tessera.engine.stat_logger import StatLogger
from tessera.engine.stats import StatsSnapshot
from tessera.executor.abstract import ExecutorDeadError
from tessera.lora.request import LoRARequest
from tessera.outputs import EmbeddingRequestOutput, RequestOutput
from tessera.pooling_params import PoolingParams
from tessera.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running this request (not the client's fault)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (client gone, or the server is shutting down)."""


class EngineShutdownError(RuntimeError):
    """The engine no longer accepts requests."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    sampling_params: SamplingParams | PoolingParams
    priority: int
    arrival_time: float
    accepted: asyncio.Future  # set once the engine has taken (or refused) the request
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_ids: list[str] | None  # None: every request in flight


_STOP = object()
IDLE_HEALTH_CHECK_S = 1.0


class AsyncLLMEngine:
    """Asyncio front of one `LLMEngine`. Call `start()` from the event loop, `shutdown()` at exit.

    `engine` is anything with the `LLMEngine` interface (tests use a fake). `engine_thread`, if
    given, is the thread that built it, which then also runs the loop."""

    def __init__(self, engine: Any, engine_thread: EngineThread | None = None) -> None:
        self.engine = engine
        self._engine_thread = engine_thread
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.config.model.max_model_len
        self.max_num_seqs: int = engine.config.scheduler.max_num_seqs
        self.max_logprobs: int = getattr(engine.config.model, "max_logprobs", 20)
        self.scheduling_policy = engine.config.scheduler.scheduling_policy
        # the server tokenizes on the event loop with this copy; the engine thread keeps the
        # original
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.vocab_size: int = getattr(engine, "vocab_size", None) or len(self.tokenizer)
        self.on_finished: list[Any] = []  # callbacks(RequestOutput) run on the event loop
        self.on_fatal: list[Any] = []  # callbacks() run on the engine thread when it dies
        self.fatal_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        # steps ran since the heap last gave its free pages back (malloc_tuning.py: the server
        # keeps step buffers in the heap while busy and trims it after a second idle)
        self._heap_dirty = False
        self._streams: dict[str, asyncio.Queue] = {}  # event-loop side only
        self._in_engine: set[str] = set()  # engine-thread side only
        self._metrics: dict[str, float] = dict(engine.get_metrics())
        self._stats: StatsSnapshot = engine.get_stats()
        # the live view (/dashboard): the event loop asks, the engine thread answers between
        # steps with a sample handed to `on_dashboard` on the event loop
        self.on_dashboard: Any = None
        self._dashboard_wanted = False
        self._dashboard_min_interval_s = 0.0
        self._dashboard_last = -float("inf")  # time.monotonic() of the last sample
        # vLLM's periodic "Avg prompt throughput ..." line, while there is work
        self.stat_logger = StatLogger()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False

    @classmethod
    def from_engine_args(cls, engine_args: Any, step_log: str | None = None) -> AsyncLLMEngine:
        """Build the `LLMEngine` on its thread; with `step_log`, it writes its step log there
        (tessera/engine/step_log.py)."""
        from tessera.engine.llm_engine import LLMEngine

        thread = EngineThread()
        return cls(thread.call(LLMEngine.from_engine_args, engine_args, None, step_log), thread)

    # -- event-loop side --------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; outputs will be delivered on the running event loop."""
        assert self._thread is None, "already started"
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        if self._engine_thread is not None:
            self._engine_thread.run(self._run)
            self._thread = self._engine_thread.thread
        else:
            self._thread = threading.Thread(target=self._run, name="tessera-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_accepting(self) -> bool:
        """False once shutdown has begun (new requests get EngineShutdownError)."""
        return self._accepting and self.is_running

    def get_metrics(self) -> dict[str, float]:
        """The engine's counters as of its last step (a snapshot; never blocks on the engine)."""
        return self._metrics

    def get_stats(self) -> StatsSnapshot:
        """The engine's histograms and labelled counters as of the last step (a copy)."""
        return self._stats

    def set_dashboard_active(self, active: bool) -> None:
        """While True the engine records each step's batch for the live view (a page is open)."""
        recorder = getattr(self.engine, "dashboard", None)
        if recorder is not None:
            if active and not recorder.active:
                recorder.reset()  # deque and set swaps: safe beside the engine thread
            recorder.active = active  # one bool the engine thread reads per step

    def request_dashboard_snapshot(self, min_interval_s: float = 0.0) -> None:
        """Ask for one sample: the engine thread builds it after its current step (at once when
        idle), but not sooner than `min_interval_s` after the previous one, and calls
        `on_dashboard(sample)` on the event loop. Requests before it answers are one request."""
        self._dashboard_min_interval_s = min_interval_s
        self._dashboard_wanted = True
        self._wake.set()

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | PoolingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[Any]:
        """Hand a request to the engine; return its output stream once the engine has accepted it.
        (With `PoolingParams` the stream yields one `EmbeddingRequestOutput`.)
        `lora_request`: the LoRA adapter it runs under (None: the base model).

        Raises `ValueError` if the engine refuses the request. The stream yields the
        `RequestOutput`s that `sampling_params.output_kind` asks for (cumulative, deltas, or only
        the final one) and ends after the finished one. Closing the stream early (or the task
        consuming it being cancelled) aborts the request."""
        if not self.is_accepting:
            raise EngineShutdownError("the engine is shutting down")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(sampling_params, SamplingParams):
            await self.check_constraints(sampling_params)
        assert self._loop is not None
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        accepted = self._loop.create_future()
        self._send(_Add(request_id, prompt, sampling_params, priority, time.monotonic(), accepted,
                        lora_request))
        try:
            await accepted
        except asyncio.CancelledError:
            self._streams.pop(request_id, None)
            self.abort(request_id)  # cancelled while queued: the add may still land
            raise
        except Exception:
            self._streams.pop(request_id, None)
            raise
        return self._iterate(request_id, stream)

    async def check_constraints(self, sampling_params: SamplingParams) -> None:
        """The engine's checks of a request's token ids and grammar (ValueError). Compiling a
        grammar takes ms to seconds, so it runs in a worker thread, off both the event loop and
        the engine thread; the engine then finds the grammar in its cache."""
        if sampling_params.structured_outputs is not None:
            await asyncio.to_thread(self.engine.check_constraints, sampling_params)
        else:
            sampling_params.check_vocab(self.vocab_size)

    @property
    def lora_enabled(self) -> bool:
        return getattr(self.engine.config, "lora", None) is not None

    def check_lora_sync(self, lora_request: LoRARequest) -> None:
        """The engine's check of an adapter (ValueError naming the field): reads its config and
        its weights' header. Thread-safe; cached per adapter."""
        self.engine.loras.check(lora_request)

    async def check_lora(self, lora_request: LoRARequest) -> None:
        """`check_lora_sync` off the event loop (it reads files)."""
        await asyncio.to_thread(self.check_lora_sync, lora_request)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM-style one-call form of `add_request` + iterating its stream."""
        stream = await self.add_request(request_id, prompt, sampling_params, priority)
        async for output in stream:
            yield output

    async def encode(
        self,
        prompt: str | list[int],
        pooling_params: PoolingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[EmbeddingRequestOutput]:
        """vLLM's name for an embedding request: yields its one, finished, output."""
        stream = await self.add_request(request_id, prompt, pooling_params, priority)
        async for output in stream:
            yield output

    async def _iterate(
        self, request_id: str, stream: asyncio.Queue
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine side already dropped it
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests: their streams end with `RequestAbortedError`, their blocks are freed
        by the engine thread before its next step. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put_nowait(RequestAbortedError(f"request {rid} was aborted"))
        self._send(_Abort(ids))

    def abort_all(self) -> None:
        """Stop accepting requests and abort every one in flight. Safe to call from a signal
        handler or another thread."""
        self._accepting = False
        self._send(_Abort(None))

    async def shutdown(self) -> None:
        """Abort what is in flight and stop the engine thread."""
        self.abort_all()
        self._send(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        stop = getattr(self.engine, "shutdown", None)  # the executor's workers, a KV connector
        if stop is not None and (self._thread is None or not self._thread.is_alive()):
            stop()
        for rid in list(self._streams):
            self._streams.pop(rid).put_nowait(RequestAbortedError("the server is shutting down"))

    def _send(self, command: object) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """On the event loop: route outputs (or errors) of one engine step to their streams."""
        for rid, item in items:
            if isinstance(item, RequestOutput) and item.finished:
                for callback in self.on_finished:
                    try:
                        callback(item)
                    except Exception:
                        logger.exception("on_finished callback failed")
            stream = self._streams.get(rid)
            if stream is None:
                continue  # aborted on this side already
            stream.put_nowait(item)
            if isinstance(item, BaseException) or item.finished:
                del self._streams[rid]

    # -- engine-thread side -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            # clear before draining: a command sent after the drain sets it again, so no lost wakeup
            self._wake.clear()
            try:
                if not self._drain_commands():
                    break
                if not self.engine.has_unfinished_requests():
                    self._take_snapshot()
                    # idle: wake once a second to notice a dead worker without a request
                    if not self._wake.wait(IDLE_HEALTH_CHECK_S):
                        self._idle_second()
                    continue
                self._step()
                self._heap_dirty = True
            except ExecutorDeadError as e:
                logger.error(
                    "the engine's workers are gone (%s); failing the %d requests in "
                    "flight and stopping",
                    e,
                    len(self._in_engine),
                )
                self.fatal_error = e
                self._accepting = False
                self._fail_all(EngineError(f"the engine stopped: {e}"))
                for callback in self.on_fatal:
                    with contextlib.suppress(Exception):
                        callback()
                break
            except Exception as e:
                # whatever broke (a step, a bad request, our own bookkeeping), the loop lives on
                logger.exception(
                    "engine step failed; failing the %d requests in flight", len(self._in_engine)
                )
                self._fail_all(
                    EngineError(f"the engine step failed ({type(e).__name__}); see the server log")
                )
        self._fail_all(RequestAbortedError("the server is shutting down"))
        with contextlib.suppress(Exception):
            self._take_snapshot()
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:  # stop the executor's worker processes, if it has any
            try:
                shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _step(self) -> None:
        outputs = self.engine.step()
        items: list[tuple[str, RequestOutput | BaseException]] = []
        for out in outputs:
            if out.request_id not in self._in_engine:
                continue  # aborted while the step ran
            if out.finished:
                self._in_engine.discard(out.request_id)
            if out.failed:  # this request alone broke the step; the others went on
                items.append((out.request_id, EngineError(out.error or "engine failure")))
                continue
            items.append((out.request_id, out))
        self._take_snapshot()
        if items:
            self._post(items)

    def _idle_second(self) -> None:
        """A whole second without work: check the workers, and hand the heap's free pages back
        once after steps ran. Not at once on idling: the next step faults in what it needs
        again (~5 us a page here), and requests a few ms apart would pay that every time."""
        check = getattr(self.engine, "check_health", None)
        if check is not None:
            check()
        if self._heap_dirty:
            release_free_memory()
            self._heap_dirty = False

    def _take_snapshot(self) -> None:
        """What a scrape reads, copied on the engine thread between steps."""
        self._metrics = dict(self.engine.get_metrics())
        self._stats = self.engine.get_stats()
        self.stat_logger.maybe_log(self._metrics, self.engine.has_unfinished_requests())
        if self._dashboard_wanted:
            self._publish_dashboard()

    def _publish_dashboard(self) -> None:
        now = time.monotonic()
        if now - self._dashboard_last < self._dashboard_min_interval_s:
            return  # too soon: a later step (or the next request's wake-up) answers it
        self._dashboard_wanted = False
        self._dashboard_last = now
        build = getattr(self.engine, "get_dashboard_snapshot", None)
        listener = self.on_dashboard
        if build is None or listener is None or self._loop is None:
            return
        sample = build()
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(listener, sample)

    def _drain_commands(self) -> bool:
        """Apply queued adds and aborts; False once asked to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                ids = list(self._in_engine) if command.request_ids is None else command.request_ids
                self._abort_in_engine(ids, RequestAbortedError("the server is shutting down"))

    def _add(self, cmd: _Add) -> None:
        assert self._loop is not None
        if not self._accepting:
            self._resolve(cmd.accepted, EngineShutdownError("the engine is shutting down"))
            return
        try:
            lora = {} if cmd.lora_request is None else {"lora_request": cmd.lora_request}
            self.engine.add_request(
                cmd.request_id,
                cmd.prompt,
                cmd.sampling_params,
                priority=cmd.priority,
                arrival_time=cmd.arrival_time,
                **lora,
            )
        except Exception as e:
            # ValueError is the client's fault; anything else is ours but must not kill the loop
            if not isinstance(e, ValueError):
                logger.exception("add_request(%s) failed", cmd.request_id)
                e = EngineError(
                    f"could not add the request ({type(e).__name__}); see the server log"
                )
            self._resolve(cmd.accepted, e)
            return
        self._in_engine.add(cmd.request_id)
        self._resolve(cmd.accepted, None)

    def _resolve(self, fut: asyncio.Future, error: BaseException | None) -> None:
        def settle() -> None:
            if fut.done():
                return
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(settle)

    def _abort_in_engine(self, ids: list[str], error: BaseException) -> None:
        ids = [rid for rid in ids if rid in self._in_engine]
        if not ids:
            return
        self._in_engine.difference_update(ids)
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("abort_request failed for %s", ids)
        self._post([(rid, error) for rid in ids])

    def _fail_all(self, error: BaseException) -> None:
        self._abort_in_engine(list(self._in_engine), error)

    def _post(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._deliver, items)
