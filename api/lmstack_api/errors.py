"""Every failure leaves the server as an OpenAI error body: {"error": {message, type, param, code}}."""

from __future__ import annotations

import msgspec


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class APIError(Exception):
    """An HTTP error with the OpenAI body. `retry_after` (seconds) becomes a Retry-After header."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.close = close  # end the connection after the response (the request was not read whole)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorDetail(self.message, self.type, self.param, self.code))

    def headers(self) -> dict[str, str]:
        out = {"Connection": "close"} if self.close else {}
        if self.retry_after is not None:
            out["Retry-After"] = str(max(1, int(self.retry_after + 0.999)))
        return out


def clip(text: str, limit: int = 64) -> str:
    """`text` as far as an error message repeats it: a client's 1 MB string is not echoed back."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, why: str = "") -> APIError:
    extra = f": {why}" if why else ""
    return APIError(400, f"{param} is not supported by this server{extra}", param=param, code="unsupported")


def overloaded(message: str, retry_after: float = 1.0) -> APIError:
    return APIError(503, message, type="server_overloaded", code="server_overloaded", retry_after=retry_after)


# Status codes Litestar raises itself, in the OpenAI vocabulary.
_STATUS_TYPES = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_overloaded", "server_overloaded"),
}


def from_status(status: int, message: str) -> APIError:
    type_, code = _STATUS_TYPES.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None)
    )
    return APIError(status, message, type=type_, code=code)
