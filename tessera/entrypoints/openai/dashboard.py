"""`GET /dashboard` (the page) and `GET /dashboard/events` (its server-sent events): the live view
of the scheduler (tessera/engine/dashboard). Both sit behind `--api-key` like every other route;
`--disable-dashboard` leaves them out.

One `DashboardHub` per app. While at least one stream is open it asks the engine thread for a
sample every `--dashboard-interval` ms (the engine answers between steps, so a sample is never
taken more often), adds the rolling rates here on the event loop, encodes it once and hands the
same bytes to every open stream. With no stream open the engine records nothing per step.

A browser cannot put a header on the page it opens, so these two routes also take the key as
`?api_key=KEY` (the page passes it on to its event stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, StreamingResponse

from tessera.engine.async_engine import AsyncLLMEngine
from tessera.engine.dashboard.page import live_page
from tessera.engine.dashboard.rates import RollingRates

DASHBOARD_ROUTES = frozenset({"/dashboard", "/dashboard/events"})
DEFAULT_INTERVAL_MS = 250
MIN_INTERVAL_MS = 10
_QUEUE_DEPTH = 4  # samples waiting for a slow client; older ones are dropped


class DashboardHub:
    def __init__(self, engine: AsyncLLMEngine, interval_ms: int = DEFAULT_INTERVAL_MS) -> None:
        if interval_ms < MIN_INTERVAL_MS:
            raise ValueError(f"--dashboard-interval must be >= {MIN_INTERVAL_MS} (ms), "
                             f"got {interval_ms}")
        self.engine = engine
        self.interval_ms = interval_ms
        self.rates = RollingRates()
        self._streams: set[asyncio.Queue[bytes]] = set()
        self._ticker: asyncio.Task | None = None
        engine.on_finished.append(self.rates.observe_output)
        engine.on_dashboard = self._publish

    async def stream(self) -> AsyncIterator[bytes]:
        """One client's events, until it goes away."""
        queue: asyncio.Queue[bytes] = asyncio.Queue(_QUEUE_DEPTH)
        self._streams.add(queue)
        if self._ticker is None:
            self.engine.set_dashboard_active(True)
            self._ticker = asyncio.create_task(self._tick())
        try:
            while True:
                yield await queue.get()
        finally:
            self._streams.discard(queue)
            if not self._streams and self._ticker is not None:
                self.engine.set_dashboard_active(False)
                self._ticker.cancel()
                self._ticker = None

    async def _tick(self) -> None:
        while True:
            self.engine.request_dashboard_snapshot(self.interval_ms / 1e3)
            await asyncio.sleep(self.interval_ms / 1e3)

    def _publish(self, sample: dict[str, Any]) -> None:
        """On the event loop: a sample from the engine thread, to every open stream."""
        if not self._streams:
            return
        sample["rates"] = self.rates.rates(sample["time"], sample["counters"])
        sample["interval_ms"] = self.interval_ms
        data = b"data: " + json.dumps(sample, separators=(",", ":")).encode() + b"\n\n"
        for queue in self._streams:
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
            queue.put_nowait(data)


def add_dashboard_routes(app: FastAPI, engine: AsyncLLMEngine,
                         interval_ms: int = DEFAULT_INTERVAL_MS) -> DashboardHub:
    hub = DashboardHub(engine, interval_ms)
    page = live_page("dashboard/events", interval_ms)

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events() -> StreamingResponse:
        return StreamingResponse(hub.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return hub


def query_key_matches(scope: dict, expected: bytes) -> bool:
    """`?api_key=KEY` on a dashboard route, compared as `expected` (b"Bearer KEY") is."""
    if scope["path"] not in DASHBOARD_ROUTES:
        return False
    keys = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
    return bool(keys) and hmac.compare_digest(f"Bearer {keys[0]}".encode(), expected)
