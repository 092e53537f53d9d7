"""Every failure the API reports, in OpenAI's shape -- or Anthropic's on its routes.

``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status, whatever went
wrong: a bad field (pydantic's 422 becomes a 400 naming the field, the value and what is
accepted), malformed JSON, an unknown route, an ``APIError`` raised by a handler, or any
other exception (a 500 whose body names it; the traceback goes to the log). Under
``/v1/messages`` the same errors read ``{"type": "error", "error": {"type", "message"}}``
with Anthropic's error types. Bodies are ASCII JSON, so any text they quote can be sent.
"""

from __future__ import annotations

import json
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ExceptionHandler

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"
_MAX_REPORTED = 3  # validation problems listed in one message
_NOT_AN_OBJECT = ("model_attributes_type", "model_type", "dict_type")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ErrorJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message may quote client
    text that UTF-8 cannot encode (a lone surrogate), and must still be sent."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI ``type``/``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(
            message=self.message, type=_TYPE_BY_STATUS.get(self.status, "invalid_request_error"),
            param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return ErrorJSONResponse(self.body().model_dump(), status_code=self.status,
                                 headers=self.headers)


class ClientDisconnected(Exception):
    """The client went away before its response was ready; nobody reads the answer."""


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def anthropic_error_body(exc: APIError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPE_BY_STATUS.get(exc.status, "invalid_request_error"
                                         if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(path: str, exc: APIError) -> JSONResponse:
    """``exc`` in the shape of the route at ``path``."""
    if path.startswith(ANTHROPIC_PREFIX):
        return ErrorJSONResponse(anthropic_error_body(exc), status_code=exc.status,
                                 headers=exc.headers)
    return exc.response()


def _respond(request: Request, exc: APIError) -> JSONResponse:
    return error_response(request.url.path, exc)


def _param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    parts = [p for p in loc if p != "body"]
    text = ""
    for p in parts:
        if isinstance(p, int):
            text += f"[{p}]"
        elif isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool")):
            continue  # a union member's tag, e.g. "list[int]": not a field of the body
        else:
            text += f".{p}" if text else p
    return text or None


def _describe(error: dict[str, Any]) -> str:
    kind, msg = error.get("type", ""), error.get("msg", "invalid value")
    param = _param(tuple(error.get("loc", ())))
    if kind == "json_invalid":
        ctx = error.get("ctx") or {}
        where = error.get("loc", ())[-1:]
        at = f" at character {where[0]}" if where and isinstance(where[0], int) else ""
        return f"the request body is not valid JSON: {ctx.get('error', msg)}{at}"
    if param is None and kind in _NOT_AN_OBJECT:
        return ("the request body must be a JSON object, sent with "
                "'Content-Type: application/json'")
    if kind == "extra_forbidden":
        return (f"'{param}' is not a supported field here; pagedserve refuses a parameter "
                "it would otherwise ignore")
    if kind == "missing":
        return (f"missing required field '{param}'" if param
                else "the request needs a JSON body")
    msg = msg.removeprefix("Value error, ")
    if param is None:
        return msg
    shown = error.get("input")
    if isinstance(shown, (dict, list)) or shown is None:
        return f"{param}: {msg}"
    return f"{param}: {msg}, got {shown!r}"


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Pydantic's error list as one 400 naming the first bad field."""
    messages = list(dict.fromkeys(_describe(e) for e in errors))
    message = "; ".join(messages[:_MAX_REPORTED])
    if len(messages) > _MAX_REPORTED:
        message += f" (and {len(messages) - _MAX_REPORTED} more)"
    first = errors[0] if errors else {}
    param = None if first.get("type") == "json_invalid" else _param(tuple(first.get("loc", ())))
    return APIError(400, message, param=param)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return _respond(request, exc)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _respond(request, validation_error(list(exc.errors())))


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes (404) and wrong methods (405) get the same shape as everything else.
    headers = None if exc.headers is None else dict(exc.headers)
    return _respond(request, APIError(exc.status_code, str(exc.detail), headers=headers))


async def _on_client_disconnected(_: Request, __: ClientDisconnected) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; never delivered


def install_error_handlers(app: FastAPI) -> None:
    # Starlette types a handler as taking any Exception; each of these is registered for
    # (and so only ever called with) its own exception type.
    handlers = ((APIError, _on_api_error), (RequestValidationError, _on_validation_error),
                (StarletteHTTPException, _on_http_error),
                (ClientDisconnected, _on_client_disconnected))
    for exc_type, handler in handlers:
        app.add_exception_handler(exc_type, cast(ExceptionHandler, handler))
