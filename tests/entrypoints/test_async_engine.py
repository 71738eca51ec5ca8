"""AsyncLLMEngine over the fake engine: streams, aborts, failures, idling, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tessera.engine.async_engine import (
    AsyncLLMEngine,
    EngineError,
    EngineShutdownError,
    RequestAbortedError,
)
from tessera.sampling.params import SamplingParams

from .fake_engine import FakeEngine


def greedy(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


async def _started(fake: FakeEngine) -> AsyncLLMEngine:
    engine = AsyncLLMEngine(fake)
    engine.start()
    return engine


async def _until(fake: FakeEngine, predicate) -> None:
    """Wait, off the event loop, until the engine thread has made `predicate` true of the fake."""
    await asyncio.to_thread(fake.wait_until, predicate)


def test_generate_streams_cumulative_outputs():
    async def main():
        engine = await _started(FakeEngine())
        outs = [o async for o in engine.generate("abc", greedy(4), "r1")]
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    assert [o.outputs[0].text for o in outs] == ["d", "de", "def", "defg"]
    assert [o.finished for o in outs] == [False, False, False, True]


def test_concurrent_requests_and_refusals():
    async def main():
        engine = await _started(FakeEngine(max_num_seqs=4))

        async def run(i: int) -> str:
            final = None
            async for out in engine.generate("x" * (i + 1), greedy(3), f"r{i}"):
                final = out
            return final.outputs[0].text

        texts = await asyncio.gather(*(run(i) for i in range(10)))
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("bad", [], greedy())
        await engine.shutdown()
        with pytest.raises(EngineShutdownError):
            await engine.add_request("late", "x", greedy())
        return texts

    texts = asyncio.run(main())
    assert texts == ["".join(chr(97 + (i + 1 + k) % 26) for k in range(3)) for i in range(10)]


def test_closing_a_stream_aborts_the_request():
    async def main():
        fake = FakeEngine()
        engine = await _started(fake)
        stream = await engine.add_request("r1", "abc", greedy(1000))
        async for _ in stream:
            break
        await stream.aclose()
        await _until(fake, lambda: not fake.requests)
        # a consumer task cancelled mid-wait aborts too
        stream = await engine.add_request("r2", "abc", greedy(1000))
        consuming = asyncio.Event()

        async def consume():
            async for _ in stream:
                consuming.set()

        task = asyncio.create_task(consume())
        await consuming.wait()
        task.cancel()
        await _until(fake, lambda: not fake.requests)
        await engine.shutdown()
        return fake

    fake = asyncio.run(main())
    assert fake.num_aborted == 2


def test_abort_by_id_ends_the_stream():
    async def main():
        fake = FakeEngine()
        engine = await _started(fake)
        stream = await engine.add_request("r1", "abc", greedy(1000))
        engine.abort("r1")
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        await _until(fake, lambda: not fake.requests)
        await engine.shutdown()

    asyncio.run(main())


def test_step_failure_fails_in_flight_and_keeps_serving():
    async def main():
        fake = FakeEngine()
        engine = await _started(fake)
        victim = await engine.add_request("v", "__boom__", greedy(100))
        with pytest.raises(EngineError, match=r"engine step failed \(RuntimeError\)") as e:
            async for _ in victim:
                pass
        assert "boom" not in str(e.value)  # internal exception text stays in the log
        outs = [o async for o in engine.generate("abc", greedy(2), "after")]
        assert outs[-1].finished and outs[-1].outputs[0].text == "de"
        assert engine.is_running
        await engine.shutdown()

    asyncio.run(main())


def test_heap_trimmed_once_each_time_the_engine_goes_idle(monkeypatch):
    """The server keeps step buffers in the heap while busy (malloc_tuning.py) and hands the free
    pages back once its engine has been idle for a second: once per idle spell, not on every idle
    wake-up, and not while requests keep coming."""
    import tessera.engine.async_engine as async_engine

    trims = threading.Semaphore(0)
    monkeypatch.setattr(async_engine, "release_free_memory", trims.release)

    async def main():
        engine = await _started(FakeEngine())
        for rid in ("a", "b", "c"):  # back to back: no idle second between them
            async for _ in engine.generate("abc", greedy(3), rid):
                pass
        counts = [trims.acquire(blocking=False)]
        for rid in ("r1", "r2"):
            async for _ in engine.generate("abc", greedy(3), rid):
                pass
            counts.append(await asyncio.to_thread(trims.acquire, True, 5))  # trimmed on idling
            counts.append(await asyncio.to_thread(trims.acquire, True, 0.2))  # and only once
        await engine.shutdown()
        return counts

    assert asyncio.run(main()) == [False, True, False, True, False]


def test_idle_loop_sleeps():
    async def main():
        fake = FakeEngine()
        calls = 0
        polled, spinning = threading.Event(), threading.Event()
        has_unfinished = fake.has_unfinished_requests

        def counting() -> bool:
            nonlocal calls
            calls += 1
            polled.set()
            if calls > 2:
                spinning.set()
            return has_unfinished()

        fake.has_unfinished_requests = counting
        engine = await _started(fake)
        assert await asyncio.to_thread(polled.wait, 5)  # the loop is up and found no work
        # nothing wakes it now: a third look within 0.3 s would be a busy loop
        spun = await asyncio.to_thread(spinning.wait, 0.3)
        await engine.shutdown()
        return spun

    assert not asyncio.run(main())


def test_shutdown_aborts_in_flight():
    async def main():
        fake = FakeEngine()
        engine = await _started(fake)
        stream = await engine.add_request("r1", "abc", greedy(10_000))
        await anext(stream)  # in flight
        await engine.shutdown()
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        assert not fake.requests and not engine.is_running

    asyncio.run(main())


def test_metrics_snapshot_follows_engine():
    async def main():
        fake = FakeEngine()
        engine = await _started(fake)
        # the engine thread takes the snapshot after a step and before posting its outputs, so an
        # output received is the event after which the snapshot shows that step
        stream = await engine.add_request("r1", "abc", greedy(10_000))
        await anext(stream)
        assert engine.get_metrics()["tessera:num_requests_running"] == 1
        await stream.aclose()  # its abort is queued before r2's add: r2's step runs without r1
        outs = [o async for o in engine.generate("x", greedy(1), "r2")]
        assert outs[-1].finished
        assert engine.get_metrics()["tessera:num_requests_running"] == 0
        await engine.shutdown()

    asyncio.run(main())


def test_from_engine_args_builds_the_engine_on_the_thread_that_steps_it(monkeypatch):
    """torch's thread pools run 2.6x slower on a thread other than the one that loaded the model
    (tessera/engine/engine_thread.py): loading and stepping share one thread, not the caller's."""
    from tessera.engine import llm_engine

    built_on: list[int] = []
    stepped_on: set[int] = set()

    class RecordingEngine(FakeEngine):
        def step(self):
            stepped_on.add(threading.get_ident())
            return super().step()

    def build(args, bundle=None, step_log=None):
        built_on.append(threading.get_ident())
        return RecordingEngine()

    monkeypatch.setattr(llm_engine.LLMEngine, "from_engine_args", staticmethod(build))

    async def main():
        engine = AsyncLLMEngine.from_engine_args(object())
        engine.start()
        outs = [o async for o in engine.generate("abc", greedy(3), "r1")]
        await engine.shutdown()
        return engine, outs

    engine, outs = asyncio.run(main())
    assert outs[-1].outputs[0].text == "def"
    assert built_on and built_on[0] != threading.get_ident()
    assert stepped_on == {built_on[0]}
    assert not engine.is_running


def test_engine_thread_hands_back_results_and_errors_in_order():
    from tessera.engine.engine_thread import EngineThread

    thread = EngineThread("test-engine-thread")
    assert thread.call(lambda a, b: (a + b, threading.get_ident()), 2, 3) == (
        5,
        thread.thread.ident,
    )
    with pytest.raises(ValueError, match="bad flag"):
        thread.call(lambda: (_ for _ in ()).throw(ValueError("bad flag")))
    ran = threading.Event()
    thread.run(ran.set)
    thread.thread.join(5)
    assert ran.is_set() and not thread.thread.is_alive()
