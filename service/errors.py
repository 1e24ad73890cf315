"""Errors that carry their HTTP meaning.

Raised anywhere (ingress, gang server, rank actors) and mapped to
`{"error": <message>, "code": <code>}` with `status` at the HTTP edge only. They
survive Ray calls: Ray re-raises a task's exception as a subclass of its own type.
Messages are capped at MAX_MESSAGE_CHARS (an error reply stays small whatever the input).
"""
from __future__ import annotations

from typing import Any, Sequence

MAX_MESSAGE_CHARS = 1000


def describe_validation_errors(errors: Sequence[Any], where: str = "body", limit: int = 5) -> str:
    """pydantic/FastAPI validation errors as 'loc: msg; ...' for an error reply.

    At most `limit` problems, each location and message cut short, and never the input
    itself (it may be huge or secret); `where` names an error with an empty location.
    """
    problems = []
    for error in list(errors)[:limit]:
        loc = ".".join(str(part) for part in error.get("loc", ()))[:80] or where
        problems.append(f"{loc}: {str(error.get('msg', 'invalid'))[:120]}")
    more = len(errors) - len(problems)
    return "; ".join(problems) + (f" (and {more} more)" if more > 0 else "")


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message`, cut to at most `limit` characters (marked with '...')."""
    message = str(message)
    return message if len(message) <= limit else message[: limit - 3] + "..."


class GangServeError(Exception):
    """Base: a message for humans, a stable machine code, an HTTP status."""

    status: int = 500
    code: str = "internal"
    retry_after_s: float | None = None

    def __init__(self, message: str, *, code: str | None = None, retry_after_s: float | None = None):
        message = bounded(message)
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    def __reduce__(self):  # keep code/retry_after_s across pickling (Ray)
        return (_rebuild, (type(self), self.message, self.code, self.retry_after_s))


def _rebuild(cls: type[GangServeError], message: str, code: str, retry_after_s: float | None):
    return cls(message, code=code, retry_after_s=retry_after_s)


class BadRequest(GangServeError):
    """Malformed body: cannot be parsed at all."""

    status, code = 400, "malformed"


class Unauthorized(GangServeError):
    """Missing or wrong bearer token on a route that needs one."""

    status, code = 401, "unauthorized"


class NotFound(GangServeError):
    status, code = 404, "not_found"


class Conflict(GangServeError):
    """The request is valid but does not fit the current state (e.g. a checkpoint of another shape)."""

    status, code = 409, "conflict"


class NotAcceptable(GangServeError):
    status, code = 406, "not_acceptable"


class PayloadTooLarge(GangServeError):
    status, code = 413, "body_too_large"


class UnsupportedMediaType(GangServeError):
    status, code = 415, "unsupported_media_type"


class InvalidInput(GangServeError):
    """Parsed, but the wrong shape, dtype, name or values."""

    status, code = 422, "invalid_input"


class GangUnavailable(GangServeError):
    """The gang cannot serve right now (starting, rebuilding, unschedulable, a rank died)."""

    status, code = 503, "gang_unavailable"
    retry_after_s = 5.0


class Overloaded(GangServeError):
    """Too much work in flight (e.g. the ingress's bounded decoding pool is full); retry later."""

    status, code = 503, "overloaded"
    retry_after_s = 1.0


class CollectiveTimeout(GangServeError):
    """A collective did not finish within the per-request deadline."""

    status, code = 504, "collective_timeout"


class GangStartupError(GangServeError):
    """Bring-up failed in a named stage; the message says which and why."""

    status, code = 503, "gang_startup_failed"
    retry_after_s = 10.0


def error_to_wire(exc: GangServeError) -> dict[str, object]:
    """A GangServeError as a JSON-able dict (for the gang's data channel, service.transport.channel)."""
    return {"type": type(exc).__name__, "message": exc.message, "code": exc.code,
            "status": exc.status, "retry_after_s": exc.retry_after_s}


def error_from_wire(doc: dict[str, object]) -> GangServeError:
    """The inverse of error_to_wire: the same class when it is one of ours (found by name
    among GangServeError's subclasses), else a GangServeError carrying the same status."""
    classes = {cls.__name__: cls for cls in _subclasses(GangServeError)}
    cls = classes.get(str(doc.get("type")), GangServeError)
    retry = doc.get("retry_after_s")
    exc = cls(str(doc.get("message", "")), code=str(doc.get("code") or cls.code),
              retry_after_s=float(retry) if isinstance(retry, (int, float)) else None)
    if cls is GangServeError and isinstance(doc.get("status"), int):
        exc.status = int(doc["status"])  # type: ignore[arg-type]
    return exc


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out
