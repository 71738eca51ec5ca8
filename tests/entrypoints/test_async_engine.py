"""AsyncLLMEngine over the fake engine: streams, aborts, failures, idling, shutdown."""

from __future__ import annotations

import asyncio
import time

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


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


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
        await _until(lambda: not fake.requests)
        # a consumer task cancelled mid-wait aborts too
        stream = await engine.add_request("r2", "abc", greedy(1000))

        async def consume():
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        await _until(lambda: fake.num_steps > 3)
        task.cancel()
        await _until(lambda: not fake.requests)
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
        await _until(lambda: not fake.requests)
        await engine.shutdown()

    asyncio.run(main())


def test_step_failure_fails_in_flight_and_keeps_serving():
    async def main():
        fake = FakeEngine()
        engine = await _started(fake)
        victim = await engine.add_request("v", "__boom__", greedy(100))
        with pytest.raises(EngineError, match="boom"):
            async for _ in victim:
                pass
        outs = [o async for o in engine.generate("abc", greedy(2), "after")]
        assert outs[-1].finished and outs[-1].outputs[0].text == "de"
        assert engine.is_running
        await engine.shutdown()

    asyncio.run(main())


def test_idle_loop_sleeps():
    async def main():
        fake = FakeEngine()
        calls = 0
        has_unfinished = fake.has_unfinished_requests

        def counting() -> bool:
            nonlocal calls
            calls += 1
            return has_unfinished()

        fake.has_unfinished_requests = counting
        engine = await _started(fake)
        await asyncio.sleep(0.3)
        idle_calls = calls
        await engine.shutdown()
        return idle_calls

    assert asyncio.run(main()) <= 2


def test_shutdown_aborts_in_flight():
    async def main():
        fake = FakeEngine()
        engine = await _started(fake)
        stream = await engine.add_request("r1", "abc", greedy(10_000))
        await _until(lambda: fake.num_steps > 2)
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
        stream = await engine.add_request("r1", "abc", greedy(10_000))
        await _until(lambda: engine.get_metrics()["tessera:num_requests_running"] == 1)
        await stream.aclose()
        await _until(lambda: engine.get_metrics()["tessera:num_requests_running"] == 0)
        await engine.shutdown()

    asyncio.run(main())
