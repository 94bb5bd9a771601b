"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, and its status codes."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error a route answers with: HTTP `status`, and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the request is wrong (a bad value, a missing field)."""
    return ApiError(400, message, param=param, code=code)


def not_found(kind: str, object_id: str, param: str = "id") -> ApiError:
    """404: no such object for this owner (another owner's id looks the same as none)."""
    return ApiError(404, f"No such {kind}: '{object_id}'.", param=param, code=None)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")
