"""Every error leaves the server in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Client mistakes are 4xx with a message that names the field (and the limit, where there is one);
only our own bugs are 500, and those never echo internals beyond the exception's type and text.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """Raised anywhere in a handler; rendered as an OpenAI error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def error_body(status: int, message: str, *, type: str | None = None, param: str | None = None,
               code: str | int | None = None) -> dict:
    type = type or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, **kw) -> JSONResponse:
    return JSONResponse(error_body(status, message, **kw), status_code=status)


_TYPE_TAGS = {"body", "str", "int", "float", "bool", "list", "dict"}


def _describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    # drop "body" and the union-branch tags pydantic puts in locations ("str", "list[int]")
    loc = [str(p) for p in err.get("loc", ())
           if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)]
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"malformed JSON body: {detail}".rstrip(": "), None
    if kind == "extra_forbidden":
        return f"unsupported parameter: {param!r}", param
    if kind == "missing":
        return f"missing required parameter: {param!r}", param
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {err.get('msg', 'invalid value')}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, type=exc.type, param=exc.param,
                              code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_error(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return error_response(exc.status_code, message, code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")
