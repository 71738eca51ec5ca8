"""`tessera proxy`: one OpenAI endpoint in front of prefill and decode servers (disaggregation).

    client ──▶ proxy ──(1) the request with max_tokens=1,
    kv_transfer_params={"do_remote_decode"}──▶ P
                     ◀────────────── kv_transfer_params: where the prompt's KV waits ──────────────
                     P
                     ──(2) the original request + those params ───────────────────────────────────▶
                     D
           ◀──────── D's answer, streamed through as it comes ──────────────────────────────────── D

P and D are `tessera serve` instances started with --kv-transfer-config (kv_producer,
kv_consumer); requests are spread round-robin over each kind. Failures never lose a request:
a prefill instance that is down, slow past --prefill-timeout, or answers with an error just means
the decode instance prefills locally (step 2 without params). A decode instance that cannot be
reached is skipped for the next one; when none answers, or one dies mid-answer, the client gets
an OpenAI-shaped error (a 502, or an error event on a stream), never a hang.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tessera.entrypoints.openai.errors import error_body, error_response

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("authorization", "content-type")


class DisaggProxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str],
                 prefill_timeout: float = 60.0, decode_timeout: float = 600.0) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("--prefill and --decode each need at least one URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._next_prefill = itertools.cycle(range(len(self.prefill_urls)))
        self._next_decode = itertools.cycle(range(len(self.decode_urls)))
        self.prefill_timeout = prefill_timeout
        self.decode_timeout = decode_timeout
        self._client: httpx.AsyncClient | None = None
        self.num_prefill_fallbacks = 0  # requests the decode side prefilled itself

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def handle(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        params = await self._prefill(path, body, headers) if _wants_prefill(body) else None
        decode_body = dict(body)
        if params is not None:
            decode_body["kv_transfer_params"] = params
        return await self._decode(path, decode_body, headers, bool(body.get("stream")))

    async def _prefill(self, path: str, body: dict, headers: dict) -> dict | None:
        """Step 1; None means: let the decode instance prefill (logged, counted)."""
        url = self.prefill_urls[next(self._next_prefill)] + path
        prefill = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        prefill.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        try:
            r = await self.client.post(url, json=prefill, headers=headers,
                                       timeout=self.prefill_timeout)
            if r.status_code == 200:
                params = r.json().get("kv_transfer_params")
                if isinstance(params, dict):
                    return params
                reason = "its answer has no kv_transfer_params (is it a kv_producer?)"
            else:
                reason = f"HTTP {r.status_code}: {r.text[:200]}"
        except (httpx.HTTPError, ValueError) as e:
            reason = f"{type(e).__name__}: {e}"
        self.num_prefill_fallbacks += 1
        logger.warning("prefill at %s failed (%s); the decode instance prefills locally",
                       url, reason)
        return None

    async def _decode(self, path: str, body: dict, headers: dict, stream: bool) -> Response:
        """Step 2, on the next decode instance that accepts a connection."""
        start = next(self._next_decode)
        n = len(self.decode_urls)
        last_error = ""
        for k in range(n):
            url = self.decode_urls[(start + k) % n] + path
            req = self.client.build_request("POST", url, json=body, headers=headers,
                                            timeout=self.decode_timeout)
            try:
                r = await self.client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                last_error = f"{url}: {type(e).__name__}"
                logger.warning("decode instance %s unreachable (%s); trying the next", url, e)
                continue
            except httpx.HTTPError as e:
                await _log_decode_failure(url, e)
                return _bad_gateway(f"the decode instance failed ({type(e).__name__})")
            if stream and r.status_code == 200:
                return StreamingResponse(_relay(r, url), media_type="text/event-stream")
            try:
                content = await r.aread()
            except httpx.HTTPError as e:
                await _log_decode_failure(url, e)
                return _bad_gateway(f"the decode instance failed mid-answer ({type(e).__name__})")
            finally:
                await r.aclose()
            return Response(content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        return _bad_gateway(f"no decode instance is reachable ({last_error})")

    async def get_models(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        for url in self.decode_urls:
            try:
                r = await self.client.get(url + "/v1/models", headers=headers, timeout=10)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        return _bad_gateway("no decode instance is reachable")


def _wants_prefill(body: dict) -> bool:
    """One prompt, one sequence, no prompt logprobs: what a transfer can serve (else the
    decode instance does it all)."""
    prompt = body.get("prompt")
    many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return (body.get("n") in (None, 1) and not many and not body.get("echo")
            and "kv_transfer_params" not in body)


async def _relay(r: httpx.Response, url: str) -> AsyncIterator[bytes]:
    """A decode stream, byte for byte; if it breaks, an OpenAI error event and [DONE]."""
    try:
        async for chunk in r.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        await _log_decode_failure(url, e)
        err = error_body(502, f"the decode instance failed mid-stream ({type(e).__name__})",
                         code="bad_gateway")
        yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    finally:
        await r.aclose()


async def _log_decode_failure(url: str, e: Exception) -> None:
    logger.error("decode instance %s failed: %s: %s", url, type(e).__name__, e)


def _bad_gateway(message: str) -> JSONResponse:
    return error_response(502, message, code="bad_gateway")


def build_app(proxy: DisaggProxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await proxy.close()

    app = FastAPI(title="tessera proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.get_models(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def add_proxy_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "proxy", help="one OpenAI endpoint over prefill and decode servers (disaggregation)",
        description="Serve the OpenAI API by sending each request's prompt to a prefill "
                    "instance and its decoding to a decode instance (both `tessera serve "
                    "--kv-transfer-config ...`).")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill (kv_producer) servers, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode (kv_consumer) servers")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="seconds to wait for a prefill answer before the decode instance "
                        "prefills itself (default: %(default)s)")
    p.add_argument("--decode-timeout", type=float, default=600.0,
                   help="seconds without a byte from a decode instance before the client gets "
                        "an error (default: %(default)s)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_run_proxy, parser=p)


def _run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    for url in args.prefill + args.decode:
        if not url.startswith(("http://", "https://")):
            args.parser.error(f"{url!r} is not an http(s) URL")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = DisaggProxy(args.prefill, args.decode, args.prefill_timeout, args.decode_timeout)
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level=args.log_level)
    return 0
