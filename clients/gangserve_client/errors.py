"""Typed errors: every call of the client raises a `GangServeError` subclass.

- `GangServeHTTPError` and its subclasses: a non-2xx reply, with the server's
  `{"error", "code"}` as `message` and `code`, the `status`, and `retry_after_s`.
- `ServiceUnreachableError`: no reply at all (connection refused or dropped) after the
  retries allowed.
- `JobTimeoutError`: `TrainingClient.wait` gave up.

Arrays that the wire formats cannot carry raise `codecs.WireFormatError` (a ValueError)
before anything is sent.
"""
from __future__ import annotations

import httpx


class GangServeError(Exception):
    """Base of everything the client raises about the service."""


class GangServeHTTPError(GangServeError, RuntimeError):
    """A non-2xx reply; carries the server's {"error", "code"}, the status and Retry-After."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s


class BadRequestError(GangServeHTTPError):
    """400: the body could not be parsed."""


class AuthError(GangServeHTTPError):
    """401: missing or wrong bearer token (see `gangserve_client.tokens`)."""


class NotFoundError(GangServeHTTPError):
    """404: unknown route, job or dataset."""


class NotAcceptableError(GangServeHTTPError):
    """406: Accept names no format the server writes."""


class ConflictError(GangServeHTTPError):
    """409: valid, but does not fit the current state (a dataset in use, a checkpoint of another shape)."""


class PayloadTooLargeError(GangServeHTTPError):
    """413: body over the server's max_body_bytes / max_json_bytes."""


class UnsupportedMediaTypeError(GangServeHTTPError):
    """415: Content-Type (or Content-Encoding) not supported."""


class InvalidInputError(GangServeHTTPError):
    """422: wrong shape, dtype, name, non-finite values, an infeasible job, or over the server's limits."""


class OverLimitError(InvalidInputError):
    """422 over_limit: a training job or dataset that on its own exceeds a training limit."""


class QuotaExceededError(GangServeHTTPError):
    """429 quota_exceeded: a training limit is full; it fits once jobs end or are deleted (not retried)."""


class UnavailableError(GangServeHTTPError):
    """503 (or 429 with Retry-After): overloaded or the gang is not ready; retried while Retry-After allows."""


class ServerError(GangServeHTTPError):
    """500 and other 5xx without a more specific class."""


class GatewayTimeoutError(GangServeHTTPError):
    """504: the gang did not answer within the deadline."""


class ServiceUnreachableError(GangServeError, ConnectionError):
    """No reply: the connection failed (after the retries allowed). `__cause__` is httpx's error."""


class JobTimeoutError(GangServeError, TimeoutError):
    """A training job did not end within the time `wait` was given."""


_BY_STATUS: dict[int, type[GangServeHTTPError]] = {
    400: BadRequestError, 401: AuthError, 404: NotFoundError, 406: NotAcceptableError, 409: ConflictError,
    413: PayloadTooLargeError, 415: UnsupportedMediaTypeError, 422: InvalidInputError, 429: UnavailableError,
    503: UnavailableError, 504: GatewayTimeoutError,
}
_BY_CODE: dict[tuple[int, str], type[GangServeHTTPError]] = {
    (422, "over_limit"): OverLimitError,
    (429, "quota_exceeded"): QuotaExceededError,
}
MAX_MESSAGE_CHARS = 1000


def error_of(reply: httpx.Response) -> GangServeHTTPError:
    """The typed error for a non-2xx reply, with the server's message and code."""
    try:
        doc = reply.json()
        message, code = str(doc.get("error", reply.text)), str(doc.get("code", "unknown"))
    except (ValueError, AttributeError):
        message, code = reply.text, "unknown"
    retry_after = reply.headers.get("retry-after")
    try:
        retry_after_s = max(float(retry_after), 0.0) if retry_after else None
    except ValueError:  # an HTTP date: not used by gangserve; retry after a second
        retry_after_s = 1.0
    status = reply.status_code
    cls = _BY_CODE.get((status, code)) or _BY_STATUS.get(status) or (ServerError if status >= 500 else GangServeHTTPError)
    return cls(status, code, message[:MAX_MESSAGE_CHARS], retry_after_s)
