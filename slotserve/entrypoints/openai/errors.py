"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every error the server returns, from a bad field to a failed model step, goes through here so
clients (the official `openai` package among them) can parse it the same way.
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from slotserve.errors import EngineDeadError, RequestValidationError

logger = logging.getLogger(__name__)

# The `type` strings the OpenAI API uses, so clients map them to the right exception class
# (any other status: invalid_request_error).
_TYPE_BY_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error that becomes an HTTP response with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGone(Exception):  # noqa: N818 - a condition, not an error of ours
    """The client disconnected before its request was answered: a 499 without a body, and
    one debug log line (a dropped client is not the server's error)."""


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def too_deep() -> APIError:
    """A body nested past the JSON parser's depth limit (about 200), or a Python walk of one."""
    return bad_request("the request nests too deeply", None, "too_deep")


_SCALAR_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_type_tag(part: object) -> bool:
    # Union members appear in pydantic locations as tags ("str", "list[int]", "ChatMessage");
    # a client knows only its own field names and indexes.
    return isinstance(part, str) and (part in _SCALAR_TAGS or "[" in part or part[:1].isupper())


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    # FastAPI prefixes body locations with "body".
    parts = [str(p) for p in loc
             if p not in ("body", "query", "path", "header") and not _is_type_tag(p)]
    return ".".join(parts) or None


def from_pydantic_errors(errors: list[Any]) -> APIError:
    """The first pydantic error, named by its field path (`messages.0.role`)."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        if "recursion limit" in str(first.get("msg", "")):
            return too_deep()
        return bad_request(f"invalid JSON body: {first.get('msg', '')}", None, "invalid_json")
    loc = tuple(first.get("loc", ()))
    param = _loc_to_param(loc)
    msg = first.get("msg", "invalid value")
    if any(_is_type_tag(p) for p in loc):
        # A union field: pydantic reports every member's complaint; the first alone misleads.
        tried = sorted({str(p) for e in errors for p in e.get("loc", ()) if _is_type_tag(p)})
        msg = f"invalid value; expected one of: {', '.join(tried)}"
    return bad_request(f"{param}: {msg}" if param else msg, param)


def from_exception(exc: BaseException) -> APIError:
    """Any exception turned into the error response a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return bad_request(exc.message, exc.param, exc.code)
    if isinstance(exc, ValidationError):
        return from_pydantic_errors(exc.errors())
    if isinstance(exc, EngineDeadError):
        return engine_dead(503)
    if isinstance(exc, RecursionError):  # walking a client's deeply nested JSON
        return too_deep()
    return internal_error(exc)


def engine_dead(status: int) -> APIError:
    return APIError(status, "the engine has stopped and cannot serve requests",
                    code="engine_dead")


def internal_error(exc: BaseException) -> APIError:
    """An unexpected failure: the client gets an id to quote, the log gets the details (an
    exception's text and module paths are the server's business, not the client's)."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s: %s: %s", error_id, type(exc).__name__, exc,
                 exc_info=exc)
    return APIError(500, f"internal server error (error id {error_id})", code="internal_error")


def install_exception_handlers(app: FastAPI) -> None:
    """Make FastAPI's own errors (404 route, 405 method, validation) OpenAI-shaped too."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else ""
        return APIError(exc.status_code, str(exc.detail or phrase)).response()

    async def on_fastapi_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, FastAPIValidationError)
        return from_pydantic_errors(list(exc.errors())).response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s", request.method, request.url.path)
        return from_exception(exc).response()

    async def on_client_gone(request: Request, _: Exception) -> Response:
        logger.debug("client went away during %s %s", request.method, request.url.path)
        return Response(status_code=499)

    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_api_error)
    app.add_exception_handler(ValidationError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(FastAPIValidationError, on_fastapi_validation)
    app.add_exception_handler(Exception, on_unexpected)
