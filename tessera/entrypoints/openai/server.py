"""The OpenAI-compatible HTTP server: `build_app()` wires routes to an `AsyncLLMEngine`, and
`run_server()` serves it with uvicorn until SIGINT/SIGTERM.

Routes: /v1/models, /v1/completions, /v1/chat/completions (SSE when stream=true), /tokenize,
/detokenize, /health, /version, /metrics. With an API key, every /v1 route wants `Authorization: Bearer KEY`; /health,
/metrics and /version stay open for probes and scrapers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
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
from tessera.entrypoints.openai.errors import error_body, install_error_handlers
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
    code: {"model": ErrorResponse} for code in (400, 401, 404, 500, 503)
}
_SSE_OR_JSON = {"content": {"text/event-stream": {"schema": {"type": "string"}}}}


class _ApiKeyMiddleware:
    """Pure ASGI (so it never wraps `receive` and hides client disconnects): rejects /v1 requests
    without `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = json.dumps(error_body(401, "invalid or missing API key (send "
                                                  "'Authorization: Bearer <key>')",
                                             code="invalid_api_key")).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, served_model_name: str | None = None,
              api_key: str | None = None, chat_template: str | None = None, *,
              sampling_defaults: dict | None = None, log_requests: bool = False,
              allowed_origins: list[str] | None = None, root_path: str = "") -> FastAPI:
    """The FastAPI app over `engine`. The app's lifespan starts and stops the engine thread.

    `chat_template` (a Jinja template's text) replaces the model's own; `sampling_defaults` (the
    model's generation config) fill what requests leave unset; `allowed_origins` turns on CORS
    for those origins ("*": any); `root_path` is the prefix a reverse proxy serves us under."""
    model_name = served_model_name or engine.model_name
    metrics = ServerMetrics(engine.get_metrics, model_name, engine.get_stats)
    engine.on_finished.append(metrics.observe_finished)
    common = {"chat_template": chat_template, "sampling_defaults": sampling_defaults,
              "log_requests": log_requests}
    completions = OpenAIServingCompletion(engine, model_name, **common)
    chat = OpenAIServingChat(engine, model_name, **common)
    tokens = OpenAIServingTokenization(engine, model_name, **common)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.is_running:
            engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="Tessera", version=_version(), lifespan=lifespan, root_path=root_path)
    install_error_handlers(app)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
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


def run_server(engine: AsyncLLMEngine, host: str = "127.0.0.1", port: int = 8000,
               served_model_name: str | None = None, api_key: str | None = None,
               log_level: str = "info", chat_template: str | None = None,
               uvicorn_log_level: str | None = None, **app_options) -> None:
    """Serve until SIGINT/SIGTERM; returns normally (exit status 0) after a clean shutdown.
    `app_options` go to `build_app`; uvicorn logs at `uvicorn_log_level` (default: log_level)."""
    app = build_app(engine, served_model_name, api_key, chat_template, **app_options)
    config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level or log_level,
                            timeout_graceful_shutdown=10, lifespan="on",
                            root_path=app_options.get("root_path", ""))
    server = _Server(config, on_exit=engine.abort_all)
    asyncio.run(server.serve())
