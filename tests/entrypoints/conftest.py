"""Servers for the entrypoint tests: an in-process uvicorn (thread) around any app, and the real
`tessera serve` in a subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
import uvicorn

from tessera.engine.async_engine import AsyncLLMEngine
from tessera.entrypoints.openai.server import build_app

from .fake_engine import FakeEngine


class _Server(uvicorn.Server):
    """uvicorn that sets `ready` once it listens (or has given up starting)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.ready.set()

    def run(self, sockets=None) -> None:
        try:
            super().run(sockets)
        finally:
            self.ready.set()  # failed before startup() (e.g. loading the app)


class UvicornThread:
    """A real uvicorn on 127.0.0.1 (port 0) serving `app` from a background thread."""

    def __init__(self, app) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                lifespan="on")
        self.server = _Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> UvicornThread:
        self.thread.start()
        assert self.server.ready.wait(30) and self.server.started, "uvicorn did not start"
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def probe_health_while(url: str, request) -> tuple[list[float], object]:
    """Run `request()` in a thread and probe /health until it returns: (the probes' latencies in
    seconds, what `request()` returned). Shows whether a request blocks the event loop."""
    result: list = []
    with httpx.Client(base_url=url, timeout=30) as probe:
        assert probe.get("/health").status_code == 200  # connection warm
        t = threading.Thread(target=lambda: result.append(request()))
        t.start()
        latencies = []
        while t.is_alive() or not latencies:
            t0 = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
        t.join()
    assert result, "the request raised (see the thread's exception)"
    return latencies, result[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m tessera.entrypoints.cli serve ...` on a free port; waits for /health."""

    def __init__(self, *args: str, startup_timeout: float = 300) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # lives as long as the server; closed and removed by stop()
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            "w+", prefix="tessera-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tessera.entrypoints.cli", "serve", "--port",
               str(self.port), "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server did not come up:\n{self.output()}")
            time.sleep(0.25)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-5000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)
        return self.proc.returncode


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


def serve_fake(api_key: str | None = None, **engine_kw) -> tuple[UvicornThread, FakeEngine]:
    engine = FakeEngine(**engine_kw)
    app = build_app(AsyncLLMEngine(engine), api_key=api_key)
    return UvicornThread(app), engine
