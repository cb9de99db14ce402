"""Errors in the OpenAI format: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the server makes is an :class:`ApiError`; the app turns it into a JSON response
with its status and headers, and the server goes on serving.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server refuses (or fails), with the HTTP status it answers with."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - the OpenAI field's name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 naming the parameter that was wrong."""
    return ApiError(400, message, param=param, code=code)
