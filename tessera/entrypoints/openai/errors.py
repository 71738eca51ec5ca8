"""Every error leaves the server in OpenAI's shape: `{"error": {"message", "type", "param",
"code"}}`.

Client mistakes are 4xx with a message that names the field (and the limit, where there is one).
Only our own failures are 500, and those never show internal exception text (it goes to the
log): at most the exception's type. `code` is, as in OpenAI's API, a short string
("invalid_api_key", "model_not_found", "request_too_large", ...) or null, never a number.
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
               code: str | None = None) -> dict:
    type = type or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, **kw) -> JSONResponse:
    return JSONResponse(error_body(status, message, **kw), status_code=status)


_TYPE_TAGS = {"body", "str", "int", "float", "bool", "list", "dict"}


def _describe_validation_error(exc: RequestValidationError,
                               required: list[str]) -> tuple[str, str | None]:
    """(message, param) of the first error; `required`: the route body's required fields."""
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
    if kind == "missing" and param is None:  # no body at all (or an empty one)
        names = ", ".join(repr(n) for n in required) or "none"
        return ("the request body is missing: send a JSON object (Content-Type: "
                f"application/json) with the required parameters ({names})"), None
    if kind == "missing":
        return f"missing required parameter: {param!r}", param
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {err.get('msg', 'invalid value')}{more}", param


def install_error_handlers(app: FastAPI, body_models: dict[str, type] | None = None) -> None:
    """`body_models`: path -> the pydantic model of its JSON body (to name what a missing body
    lacks)."""
    body_models = body_models or {}

    def required(path: str) -> list[str]:
        model = body_models.get(path)
        fields = getattr(model, "model_fields", {})
        return [name for name, f in fields.items() if f.is_required()]

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, type=exc.type, param=exc.param,
                              code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_error(exc, required(request.url.path))
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__}); see the server log")
