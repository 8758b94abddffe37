"""The HTTP API's refusals: an `APIError` is a status and an OpenAI-style body,
`{"error": {"message", "type", "param", "code"}}`, whose message names the field and what is wrong.

`engine_failure` maps a request the engine ended without finishing to its error; `validation_error`
turns pydantic's first complaint about a request body into one.
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    """A request the server refuses, as the status and OpenAI-style error body to answer it with."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def engine_failure(finish_reason: str | None) -> APIError | None:
    """The error for a request the engine ended without finishing it ("stop" and "length" are fine)."""
    if finish_reason == "error":
        return APIError(500, "generation failed; the server's log says why", type="server_error",
                        code="generation_failed")
    if finish_reason == "cancelled":
        return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
    return None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, as `param: what is wrong`."""
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        detail, position = error.get("ctx", {}).get("error", "a syntax error"), error["loc"][-1]
        return APIError(400, f"the request body is not valid JSON: {detail} at character {position}",
                        code="invalid_json")
    param = ".".join(str(part) for part in error["loc"][1:]) or None  # loc[0] is "body"
    if param is None and error["type"] == "missing":
        return APIError(400, "the request body is empty; send a JSON object", code="invalid_value")
    if param is None and isinstance(error.get("input"), bytes):  # a body FastAPI did not parse as JSON
        return APIError(400, "the request body must be a JSON object sent with the header "
                             "`Content-Type: application/json`", code="invalid_value")
    message = error["msg"] if error["type"] != "missing" else "this field is required"
    return APIError(400, f"{param or 'request body'}: {message}", param=param, code="invalid_value")


__all__ = ["APIError", "engine_failure", "validation_error"]
