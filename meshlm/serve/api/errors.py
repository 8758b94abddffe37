"""The HTTP API's refusals: an `APIError` is a status and an OpenAI-style body,
`{"error": {"message", "type", "param", "code"}}`, whose message names what is wrong and how to fix it,
and whose `code` is never null.

`engine_failure` maps a request the engine ended without finishing to its error; `validation_error`
turns pydantic's first complaint about a request body into one; `http_error` does the same for the
routing and body-reading errors of the web framework (no such route, wrong method, an unreadable body).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

ROUTES = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /docs"
SEND_JSON = "send one JSON object with the header `Content-Type: application/json`"
HTTP_CODES = {
    400: "bad_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
}


class APIError(Exception):
    """A request the server refuses, as the status and OpenAI-style error body to answer it with."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        code = code or HTTP_CODES.get(status) or ("server_error" if status >= 500 else f"http_{status}")
        message = message.encode("utf-8", "backslashreplace").decode()  # a lone surrogate quoted from the body
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def engine_failure(finish_reason: str | None) -> APIError | None:
    """The error for a request the engine ended without finishing it ("stop" and "length" are fine)."""
    if finish_reason == "error":
        return APIError(
            500, "generation failed; the server's log says why", type="server_error", code="generation_failed"
        )
    if finish_reason == "cancelled":
        return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
    return None


def _json_kind(value: Any) -> str:
    """How a parsed JSON value reads in a message: its JSON type, and the value when short."""
    kind = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)
    shown = json.dumps(value) if not isinstance(value, bytes) else ""
    return f"{kind} ({shown})" if value is not None and len(shown) <= 40 else kind


def _syntax_error(detail: str, document: Any, position: Any) -> APIError:
    """Where in the body the JSON parser stopped, as line and column."""
    where = f"character {position}"
    if isinstance(document, str) and isinstance(position, int):
        line = document.count("\n", 0, position) + 1
        where = f"line {line} column {position - document.rfind(chr(10), 0, position)}"
    return APIError(400, f"the request body is not valid JSON: {detail} at {where}; {SEND_JSON}", code="invalid_json")


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, as `param: what is wrong; got what`."""
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return _syntax_error(error.get("ctx", {}).get("error", "a syntax error"), exc.body, error["loc"][-1])
    param = ".".join(str(part) for part in error["loc"][1:]) or None  # loc[0] is "body"
    if param is None and error["type"] == "missing":
        return APIError(400, f"the request body is empty; {SEND_JSON}", code="invalid_value")
    if param is None and isinstance(error.get("input"), bytes):  # a body FastAPI did not parse as JSON
        return APIError(400, f"the request body was not sent as JSON; {SEND_JSON}", code="invalid_value")
    if param is None:
        return APIError(
            400,
            f"the request body is {_json_kind(error.get('input'))}, not a JSON object; {SEND_JSON}",
            code="invalid_value",
        )
    if error["type"] == "missing":
        return APIError(400, f"{param}: this field is required", param=param, code="invalid_value")
    return APIError(
        400, f"{param}: {error['msg']}; got {_json_kind(error.get('input'))}", param=param, code="invalid_value"
    )


def _unreadable_body(cause: BaseException | None) -> str:
    """Why the framework could not read a body as JSON (it says only "There was an error parsing the body")."""
    if isinstance(cause, UnicodeDecodeError):
        byte = cause.object[cause.start : cause.start + 1].hex()
        return (
            f"the request body cannot be decoded as {cause.encoding}: byte 0x{byte} at offset {cause.start} "
            f"({cause.reason}); send the JSON encoded as UTF-8"
        )
    if isinstance(cause, RecursionError):
        return "the request body nests arrays or objects too deeply to read; send a flatter JSON object"
    if isinstance(cause, ValueError):  # e.g. an integer of more than 4300 digits
        return f"the request body cannot be read as JSON: {str(cause).split(';')[0]}; {SEND_JSON}"
    return f"the request body cannot be read as JSON; {SEND_JSON}"


def http_error(exc: HTTPException, method: str, path: str) -> APIError:
    """The framework's own refusals, with what was wrong and the fix in place of its bare status phrases."""
    status, message = exc.status_code, str(exc.detail)
    path = path if len(path) <= 80 else f"{path[:80]}..."
    if status == 404:
        message = f"there is no route {method} {path}; the API is {ROUTES}"
    elif status == 405:
        allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
        message = f"{method} is not allowed on {path}" + (f"; use {allowed}" if allowed else "")
    elif status == 400 and message == "There was an error parsing the body":
        return APIError(400, _unreadable_body(exc.__cause__), code="invalid_json")
    return APIError(status, message)


def server_error() -> APIError:
    return APIError(500, "internal server error; the server's log says why", type="server_error", code="internal_error")


__all__ = ["APIError", "engine_failure", "validation_error", "http_error", "server_error"]
