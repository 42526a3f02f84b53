"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the right status."""

from __future__ import annotations

import logging
import reprlib
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.engine.async_engine import EngineDeadError, EngineOverloadedError, EngineStepError
from pagoda.errors import InvalidRequestError, PagodaError

logger = logging.getLogger("pagoda.server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered as JSON with ``status``; raised by route handlers."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """OpenAI's error object. A message or param quoting the request (an unknown field's name, a value) may hold
    an unpaired surrogate, which UTF-8 cannot encode: such characters are written as ``\\udXXX`` escapes."""
    return {"error": {"message": _encodable(message), "type": _TYPES.get(status, "invalid_request_error"),
                      "param": None if param is None else _encodable(param), "code": code}}


def _encodable(text: str) -> str:
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


# what an error message quotes of a value: bounded, however large or deep the value is
_QUOTE = reprlib.Repr()
_QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlist, _QUOTE.maxdict, _QUOTE.maxlevel = 60, 60, 6, 4, 3


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def to_api_error(exc: BaseException) -> APIError:
    """Map pagoda's errors to HTTP statuses; anything unexpected is a 500 that says what happened."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), code="engine_error")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def unknown_path_message(method: str, path: str) -> str:
    """What a request to a path no route serves is told (``/v1/embeddings``, ``/v1/audio/...``, a typo)."""
    if path in ("/v1/embeddings", "/v1/score", "/v1/rerank", "/rerank", "/v2/rerank"):
        return (f"{method} {path} is not served by pagoda with this model, which generates text (the 'generate' "
                "task); serve an embedding model or a cross-encoder with `pagoda serve MODEL --task embed` or "
                "`--task score` for this path")
    return (f"{method} {path} is not served by pagoda; GET /openapi.json lists the routes this server has "
            "(text generation is at /v1/completions and /v1/chat/completions)")


def _describe_validation(errors: list[dict[str, Any]]) -> tuple[str, Optional[str]]:
    """One sentence per problem, naming the field; the first field is the ``param``."""
    parts, first_param = [], None
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})")
            continue
        # pydantic adds union member names to loc ("str", "list[int]"); keep the field path only
        field = ".".join(p for p in loc if not _is_union_tag(p))
        field = field or "body"
        first_param = first_param or field
        if err.get("type") == "extra_forbidden":
            parts.append(f"unrecognized request argument supplied: {field}")
        elif err.get("type") == "missing":
            parts.append(f"{field}: this field is required")
        elif err.get("type") == "string_unicode":  # pydantic's word for a length-bounded string's surrogate
            parts.append(f"{field}: contains an unpaired UTF-16 surrogate; send valid Unicode text (a JSON "
                         "\\ud800-\\udbff escape must be followed by a \\udc00-\\udfff one)")
        else:
            shown = _QUOTE.repr(err.get("input"))
            message = str(err.get("msg")).removeprefix("Value error, ")  # pydantic's prefix for our own checks
            parts.append(f"{field}: {message} (got {shown})")
    if len(errors) > 5:
        parts.append(f"and {len(errors) - 5} more problems")
    return "; ".join(parts) or "invalid request body", first_param


def _is_union_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "none") or part.startswith(
        ("list[", "dict[", "constrained-", "function-", "lax-", "literal["))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _describe_validation(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the request body could not be read as JSON; send UTF-8 encoded JSON"
        if exc.status_code == 404 and message == "Not Found":  # no route has this path
            return error_response(404, unknown_path_message(request.method, request.url.path), code="unknown_url")
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    # pagoda's own errors are answered here; only truly unexpected ones reach the 500 handler below,
    # which Starlette runs outermost and follows by re-raising (the connection is then closed)
    @app.exception_handler(PagodaError)
    async def _pagoda_error(request: Request, exc: PagodaError):
        err = to_api_error(exc)
        return error_response(err.status, err.message, err.param, err.code, err.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        err = to_api_error(exc)
        return error_response(err.status, err.message, err.param, err.code, err.headers)


# what any operation may answer besides its own success: the guard (key, size, body deadline, Host) runs in
# front of every route, and every engine-backed route can meet a full queue, a shutdown or an engine fault
ERROR_STATUSES = {
    "400": "Bad request: invalid JSON, a field out of range (the message names it), a prompt that cannot fit",
    "401": "Missing or wrong API key (only when the server has one)",
    "404": "Unknown model",
    "408": "The request body did not arrive within --request-body-timeout",
    "413": "The request body is over --max-request-bytes",
    "500": "The engine failed while running this request; the server serves on",
    "503": "Overloaded (with Retry-After), shutting down, or the engine cannot serve",
}
ERROR_SCHEMA = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def document_errors(app: FastAPI) -> None:
    """Make the app's OpenAPI document say what the server answers: errors are 400 in OpenAI's shape, not
    FastAPI's 422, and every operation lists the error statuses the guard and the engine can give."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            components["ErrorResponse"] = ERROR_SCHEMA
            error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.setdefault("responses", {})
                    responses.pop("422", None)
                    for status, description in ERROR_STATUSES.items():
                        responses.setdefault(status, {"description": description, "content": error})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
