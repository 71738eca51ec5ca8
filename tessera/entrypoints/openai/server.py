"""The OpenAI-compatible HTTP server: `build_app()` wires routes to an `AsyncLLMEngine`, and
`run_server()` serves it with uvicorn until SIGINT/SIGTERM.

Routes: /v1/models, /v1/completions, /v1/chat/completions (SSE when stream=true), /tokenize,
/detokenize, /health, /version, /metrics, the OpenAPI docs (/docs, /redoc, /openapi.json), and
the live view /dashboard with its event stream /dashboard/events (openai/dashboard.py).

With an API key, every route wants `Authorization: Bearer KEY` (the docs too: the schema maps
the whole API, so it is no more public than the API), except `OPEN_ROUTES`:
- /health: liveness probes (load balancers, Kubernetes) cannot be given a secret, and a 200 or
  503 tells nobody anything about the requests;
- /metrics: Prometheus scrapers, likewise; it holds aggregate counters and histograms only (no
  prompt, no output, no request id);
- /version: the package version, for the same tooling.
Any other path without the key is a 401 (even an unknown one: no route list leaks). The two
dashboard routes also take it as `?api_key=KEY`: a browser cannot add a header to a page it opens.

Bodies: a request body over `max_request_body_bytes` (--max-request-body-bytes) is a 413 before
any of it is parsed; a declared Content-Length over the limit is refused before the body is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from tessera.engine.async_engine import AsyncLLMEngine
from tessera.engine.metrics import CONTENT_TYPE, ServerMetrics
from tessera.entrypoints.openai import DEFAULT_MAX_REQUEST_BODY_BYTES
from tessera.entrypoints.openai.dashboard import (
    DEFAULT_INTERVAL_MS,
    add_dashboard_routes,
    query_key_matches,
)
from tessera.entrypoints.openai.errors import error_body, install_error_handlers
from tessera.entrypoints.openai.preprocess import Preprocessor
from tessera.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from tessera.entrypoints.openai.serving_chat import OpenAIServingChat
from tessera.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tessera.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)
}
_SSE_OR_JSON = {"content": {"text/event-stream": {"schema": {"type": "string"}}}}
OPEN_ROUTES = frozenset({"/health", "/metrics", "/version"})  # no API key needed (see above)


async def _send_error(send, status: int, message: str, code: str | None,
                      headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class _ApiKeyMiddleware:
    """Pure ASGI (so it never wraps `receive` and hides client disconnects): rejects requests
    without `Authorization: Bearer <key>`, except on OPEN_ROUTES."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not (hmac.compare_digest(given, self.expected)
                    or query_key_matches(scope, self.expected)):
                await _send_error(send, 401, "invalid or missing API key (send "
                                  "'Authorization: Bearer <key>')", "invalid_api_key",
                                  ((b"www-authenticate", b"Bearer"),))
                return
        await self.app(scope, receive, send)


class _RootPathMiddleware:
    """Pure ASGI: serve under `root_path` behind a reverse proxy, as uvicorn's --root-path does
    (FastAPI's own `root_path` argument is deprecated). Routes match with or without the
    prefix, and the docs page links the prefixed openapi.json."""

    def __init__(self, app, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    """Pure ASGI: a body over `limit` bytes is a 413, decided from Content-Length before reading
    or, for a chunked body, as soon as the bytes received pass the limit. The body is read here
    (FastAPI reads it whole anyway) and replayed; later `receive` calls pass through, so client
    disconnects still reach the handlers."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send, int(declared))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)  # gone already
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(send, size, more=message.get("more_body", False))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, send, size: int, more: bool = False) -> None:
        at_least = "at least " if more else ""
        await _send_error(send, 413, f"the request body has {at_least}{size} bytes, more than "
                          f"this server's limit of {self.limit} (--max-request-body-bytes)",
                          "request_too_large", ((b"connection", b"close"),))


def _replay(messages: list[dict], receive):
    """A `receive` that returns `messages` first, then defers to the real one."""
    pending = list(messages)

    async def replay() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


def build_app(engine: AsyncLLMEngine, served_model_name: str | None = None,
              api_key: str | None = None, chat_template: str | None = None, *,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              sampling_defaults: dict | None = None, log_requests: bool = False,
              allowed_origins: list[str] | None = None, root_path: str = "",
              tool_call_parser: str | None = None, enable_dashboard: bool = True,
              dashboard_interval_ms: int = DEFAULT_INTERVAL_MS) -> FastAPI:
    """The FastAPI app over `engine`. The app's lifespan starts and stops the engine thread.

    `chat_template` (a Jinja template's text) replaces the model's own; `sampling_defaults` (the
    model's generation config) fill what requests leave unset; `allowed_origins` turns on CORS
    for those origins ("*": any); `root_path` is the prefix a reverse proxy serves us under;
    `tool_call_parser` (tessera/entrypoints/openai/tool_parsers.py) enables tool_choice "auto";
    `enable_dashboard` serves /dashboard, sampled every `dashboard_interval_ms` at most."""
    if max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {max_request_body_bytes}")
    model_name = served_model_name or engine.model_name
    metrics = ServerMetrics(engine.get_metrics, model_name, engine.get_stats)
    engine.on_finished.append(metrics.observe_finished)
    preprocessor = Preprocessor(engine.tokenizer, engine.max_model_len, engine.vocab_size)
    common = {"chat_template": chat_template, "sampling_defaults": sampling_defaults,
              "log_requests": log_requests, "tool_call_parser": tool_call_parser}
    completions = OpenAIServingCompletion(engine, model_name, preprocessor, **common)
    chat = OpenAIServingChat(engine, model_name, preprocessor, **common)
    tokens = OpenAIServingTokenization(engine, model_name, preprocessor, **common)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.is_running:
            engine.start()
        yield
        await engine.shutdown()
        preprocessor.shutdown()

    app = FastAPI(title="Tessera", version=_version(), lifespan=lifespan)
    install_error_handlers(app, {"/v1/completions": CompletionRequest,
                                 "/v1/chat/completions": ChatCompletionRequest})
    # added last runs first: the key is checked before a body is read
    app.add_middleware(_BodyLimitMiddleware, limit=max_request_body_bytes)
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    if root_path:
        app.add_middleware(_RootPathMiddleware, root_path=root_path)
    if allowed_origins:  # outermost: preflights need no key, and errors carry CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    app.state.engine = engine

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body(503, "engine is not running"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=engine.max_model_len)])

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={200: _SSE_OR_JSON, **_ERRORS})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={200: _SSE_OR_JSON, **_ERRORS})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        return await tokens.tokenize(body, chat)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await tokens.detokenize(body)

    if enable_dashboard:
        add_dashboard_routes(app, engine, dashboard_interval_ms)
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tessera")
    except PackageNotFoundError:
        return "0.0.0"


class _Server(uvicorn.Server):
    """uvicorn, but on SIGINT/SIGTERM it also aborts in-flight requests (so streams end and the
    graceful shutdown is quick) and it does not re-raise the signal afterwards: we exit 0."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            logger.info("received %s: aborting in-flight requests and shutting down",
                        signal.Signals(sig).name)
            self._on_exit()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind and listen on host:port now (OSError if it is taken): `tessera serve` does this
    before loading the model, so a busy port fails in milliseconds, not after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_server(engine: AsyncLLMEngine, host: str = "127.0.0.1", port: int = 8000,
               served_model_name: str | None = None, api_key: str | None = None,
               log_level: str = "info", sock: socket.socket | None = None,
               chat_template: str | None = None, uvicorn_log_level: str | None = None,
               **app_options) -> int:
    """Serve until SIGINT/SIGTERM, or until the engine dies (its workers are gone); returns the
    exit status: 0 after a clean shutdown, 1 when the engine died.
    `sock`: a socket bound already (see `bind_socket`); else host:port is bound here.
    `app_options` go to `build_app`; uvicorn logs at `uvicorn_log_level` (default: log_level)."""
    app = build_app(engine, served_model_name, api_key, chat_template, **app_options)
    config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level or log_level,
                            timeout_graceful_shutdown=10, lifespan="on")
    server = _Server(config, on_exit=engine.abort_all)

    def engine_died() -> None:  # on the engine thread; uvicorn polls the flag
        server.should_exit = True

    engine.on_fatal.append(engine_died)
    asyncio.run(server.serve(sockets=[sock] if sock is not None else None))
    return 1 if engine.fatal_error is not None else 0
