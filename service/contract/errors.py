"""Errors that carry their HTTP meaning, and the one registry of their codes.

`ErrorCode` lists every machine code the service answers with: its wire string (the public
contract: never renamed), the HTTP statuses it is sent with, whether the ingress retries an
inference request through it, and a line saying when it happens. docs/api.md's error table
is generated from it (`python -m service.contract.errors`; `make docs` writes it into docs/api.md).

The errors below are raised anywhere (ingress, gang server, rank actors) and mapped to
`{"error": <message>, "code": <code>}` with `status` at the HTTP edge only. They survive
Ray calls: Ray re-raises a task's exception as a subclass of its own type. Messages are
capped at MAX_MESSAGE_CHARS (an error reply stays small whatever the input).

This module imports nothing from `service`.
"""
from __future__ import annotations

import argparse
import enum
import sys
from pathlib import Path
from typing import Any, Sequence

from service.contract.gang_status import AbsentState, AnyState, GangState, ObservedState

MAX_MESSAGE_CHARS = 1000


class ErrorCode(enum.StrEnum):
    """Every `code` of an error reply. A member is its wire string (a `str`), so it
    compares, formats, pickles and JSON-encodes as that string.

    `statuses`: the HTTP statuses it is sent with, the usual one first (empty: the
    framework's own status, whatever it is); `retryable`: the ingress retries an inference
    request through it while the request's deadline allows (a failure of the gang, not of
    the request); `meaning`: when it happens (one line, the generated docs table's).
    """

    statuses: tuple[int, ...]
    retryable: bool
    meaning: str

    def __new__(cls, value: str, statuses: tuple[int, ...], retryable: bool, meaning: str) -> "ErrorCode":
        member = str.__new__(cls, value)
        member._value_ = value
        member.statuses, member.retryable, member.meaning = statuses, retryable, meaning
        return member

    @property
    def status(self) -> int:
        """The usual HTTP status (the first of `statuses`; 500 for a code without one)."""
        return self.statuses[0] if self.statuses else 500

    # -- 400 .. 415: the request itself
    MALFORMED = "malformed", (400,), False, (
        "the body cannot be parsed (bad JSON, not an npy file, a lying safetensors header, empty), or "
        "`Content-Length` is not an integer")
    UNAUTHORIZED = "unauthorized", (401,), False, (
        "a token is missing or wrong (the default of a 401; the service sends the two codes below)")
    MISSING_TOKEN = "missing_token", (401,), False, (
        "a route that needs a token (see [Auth](#auth)) without `Authorization: Bearer <token>` (no header, "
        "or another scheme); has `WWW-Authenticate: Bearer`")
    INVALID_TOKEN = "invalid_token", (401,), False, (
        "the bearer token is not the one the route needs; has `WWW-Authenticate: Bearer`")
    NOT_FOUND = "not_found", (404,), False, "unknown route, or an OIP model version other than the served one"
    JOB_NOT_FOUND = "job_not_found", (404,), False, "no training job with that id"
    DATASET_NOT_FOUND = "dataset_not_found", (404, 422), False, (
        "no dataset with that id: 404 on the dataset's own routes, 422 when a job spec names it")
    CHECKPOINT_NOT_FOUND = "checkpoint_not_found", (404,), False, (
        "a finished job's final checkpoint is gone from the artifact store")
    WEIGHTS_VERSION_NOT_FOUND = "weights_version_not_found", (404,), False, (
        "`POST /weights {\"version\": N}`: version N is not recorded (`GET /weights` lists them)")
    SESSION_NOT_FOUND = "session_not_found", (404,), False, (
        "no session with that id on the gang that holds it (never opened, or ended by `DELETE`, "
        "`sequence_end`)")
    SESSION_EXPIRED = "session_expired", (404,), False, (
        "the session was idle longer than `session_idle_timeout_s` and was ended")
    METHOD_NOT_ALLOWED = "method_not_allowed", (405,), False, "the route exists, but not with this method"
    NOT_ACCEPTABLE = "not_acceptable", (406,), False, "`Accept` names no supported format"
    CONFLICT = "conflict", (409,), False, "valid, but does not fit the current state (the default of a 409)"
    JOB_FINISHED = "job_finished", (409,), False, "cancelling a job that already ended"
    NO_CHECKPOINT = "no_checkpoint", (409,), False, "the job has no final checkpoint (it did not succeed)"
    CHECKPOINT_MISMATCH = "checkpoint_mismatch", (409,), False, (
        "a checkpoint that does not fit the served model (`embed_dim`, `num_heads`)")
    DATASET_IN_USE = "dataset_in_use", (409,), False, "deleting a dataset that active jobs use"
    ILLEGAL_TRANSITION = "illegal_transition", (409,), False, (
        "a job status change the transition table refuses (e.g. out of a terminal status)")
    INIT_FROM_NOT_READY = "init_from_not_ready", (409,), False, (
        "`init_from` names a job without a final checkpoint (yet), or weights that cannot be read or "
        "generated again")
    EVAL_GATE = "eval_gate", (409,), False, (
        "`POST /weights` with `max_eval_loss`: the job's final eval loss is above it, or it has none")
    WEIGHTS_STAGE_FAILED = "weights_stage_failed", (409,), False, (
        "a rank cannot read the new weights; nothing changed")
    WEIGHTS_VERSION_UNAVAILABLE = "weights_version_unavailable", (409,), False, (
        "a recorded weights version that cannot be served again (its file is gone or corrupt, or `init` "
        "generated it under an earlier config)")
    SESSION_EXISTS = "session_exists", (409,), False, (
        "OIP `sequence_start` with a `sequence_id` whose session is live (end it first, or append without "
        "`sequence_start`)")
    SESSION_LENGTH_MISMATCH = "session_length_mismatch", (409,), False, (
        "an append's `?length=` precondition (the session's length before it) does not hold; nothing "
        "was appended")
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused", (409,), False, (
        "a session append's `Idempotency-Key` (OIP: `idempotency_key`) was used before on this session "
        "for other rows (another digest of their bytes, shape and dtype); nothing was appended")
    SESSION_LOST = "session_lost", (410,), False, (
        "the gang that held the session is gone (its GangServer replica was lost or replaced): the "
        "session's registry died with it; open a new session")
    BODY_TOO_LARGE = "body_too_large", (413,), False, (
        "body over `max_body_bytes`, or a JSON body (also after gzip/deflate) over `max_json_bytes` "
        "(refused from `Content-Length` before reading)")
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type", (415,), False, (
        "`Content-Type` not one of the three (OIP: not JSON or octet-stream; `Content-Encoding` not "
        "gzip/deflate)")
    # -- 422: parsed, but not valid
    INVALID_INPUT = "invalid_input", (422,), False, (
        "wrong shape/embed dim, a dtype other than the four below (named: `float128`, `complex64`, "
        "`int64`, ...), NaN/Inf, pickled npy, wrong tensor name, over `max_seq_len` / "
        "`max_tokens_per_request`, a JSON body shaped like no tensor (millions of lists, objects, keys or "
        "strings); an `attention_mask` of the wrong shape or dtype, with values other than 0/1, or with a "
        "sequence that is all padding; a non-boolean OIP `parameters.causal`")
    SESSION_TOO_LONG = "session_too_long", (422,), False, (
        "an append that would take the session past `max_session_tokens`; nothing was appended")
    INVALID_REQUEST = "invalid_request", (422,), False, (
        "parameters that fail the route's schema, a `limit`/`tail` out of range, a cursor `GET /train` did "
        "not return, or a `POST /weights` body naming not exactly one source")
    INVALID_DEADLINE = "invalid_deadline", (422,), False, (
        "`X-Request-Timeout-Seconds` or OIP `parameters.timeout` not a finite number > 0 (at most 86400 s)")
    INVALID_SPEC = "invalid_spec", (422,), False, "a training job spec that fails validation"
    INVALID_DATASET = "invalid_dataset", (422,), False, (
        "an uploaded dataset that is not one (its tensors' names, shapes or dtypes)")
    DATASET_MISMATCH = "dataset_mismatch", (422,), False, "the job's dataset does not fit its spec"
    INFEASIBLE = "infeasible", (422,), False, "the cluster can never hold the training job's workers"
    OVER_LIMIT = "over_limit", (422,), False, (
        "a training job or dataset that on its own exceeds a [training limit]"
        "(training.md#limits-and-retention), named in the message")
    PATH_OUTSIDE_STATE_DIR = "path_outside_state_dir", (422,), False, (
        "a checkpoint path that is not inside the artifact store")
    INIT_FROM_MISMATCH = "init_from_mismatch", (422,), False, (
        "`init_from` weights of another shape than the job's model")
    INIT_FROM_NOT_FOUND = "init_from_not_found", (422,), False, (
        "`init_from` names a job or a weights version that does not exist")
    # -- 429
    QUOTA_EXCEEDED = "quota_exceeded", (429,), False, (
        "a training limit is full (active jobs, their workers or GPUs, stored datasets or their bytes); "
        "no `Retry-After`: it fits once jobs end or are deleted")
    TOO_MANY_SESSIONS = "too_many_sessions", (429,), False, (
        "`max_sessions` sessions are open on the gang; has `Retry-After` (idle ones expire after "
        "`session_idle_timeout_s`)")
    # -- 500 and the framework's own
    INTERNAL = "internal", (500,), False, "an unexpected failure; its traceback is in the service log"
    HTTP_ERROR = "http_error", (), False, "any other HTTP error of the web framework, with its status"
    # -- 503: the gang (inference waits and retries through the retryable ones until its deadline)
    GANG_UNAVAILABLE = "gang_unavailable", (503,), True, "the gang cannot serve right now (the default of a 503)"
    GANG_STARTING = "gang_starting", (503,), True, "the gang is being brought up"
    GANG_BROKEN = "gang_broken", (503,), True, (
        "a rank died or a collective failed; the gang is being rebuilt")
    GANG_REBUILDING = "gang_rebuilding", (503,), True, "the gang is being rebuilt in place"
    GANG_STOPPED = "gang_stopped", (503,), True, "the gang was shut down (its replica is going away)"
    GANG_SCHEDULING = "gang_scheduling", (503,), True, (
        "no gang server answers yet; the cluster can hold the gang (its resources are awaited)")
    GANG_RESTARTING = "gang_restarting", (503,), True, (
        "the gang server's replica is gone and Serve is restarting it")
    GANG_UNREACHABLE = "gang_unreachable", (503,), True, (
        "the gang server cannot be reached (its reports stopped, or a call to it failed)")
    WEIGHTS_VERSION_MISMATCH = "weights_version_mismatch", (503,), True, (
        "the ranks held different weights versions: nothing was computed from mixed weights, and the gang "
        "is rebuilt with the recorded version")
    WEIGHTS_COMMIT_FAILED = "weights_commit_failed", (503,), True, (
        "a weights commit failed on a rank; the gang is rebuilt with the recorded version")
    GANG_ERROR = "gang_error", (503,), False, (
        "the gang server failed unexpectedly (see the service log), or replied with another shape")
    GANG_STARTUP_FAILED = "gang_startup_failed", (503,), False, "bring-up failed in a named stage (the message says which)"
    WEIGHTS_RECORD_BROKEN = "weights_record_broken", (503,), False, (
        "the recorded served weights cannot be loaded at bring-up")
    UNSCHEDULABLE = "unschedulable", (503,), False, (
        "the cluster can never place the gang (needed vs available in the message)")
    SCHEDULE_TIMEOUT = "schedule_timeout", (503,), False, "gave up waiting for placement (`schedule_timeout_s`)"
    OVERLOADED = "overloaded", (503,), False, (
        "too much work in flight: `max_queued_requests` requests wait for a gang, the ingress's decoding "
        "pool is full (`max_pending_decodes`), or Serve's queue is")
    DEADLINE_UNMEETABLE = "deadline_unmeetable", (503,), False, (
        "no gang is expected back before the request's deadline (the last outage's length says when)")
    INCOMPLETE_BODY = "incomplete_body", (503,), False, (
        "the body arrived short, or mixed with another HTTP request's bytes, on its way to the ingress "
        "(a replica died mid-request); a retry will do")
    CHANNEL_ERROR = "channel_error", (503,), False, (
        "a bad request on the gang server's data channel (between the ingress and rank 0)")
    CONTROLLER_UNREACHABLE = "controller_unreachable", (503,), False, (
        "the Controller (fleet view, weights record) did not answer, or the app has none")
    CONTROLLER_RESTARTING = "controller_restarting", (503,), False, (
        "the Controller's replica is gone and Serve is restarting it")
    CONTROLLER_ERROR = "controller_error", (503,), False, "the Controller failed unexpectedly (see the service log)"
    JOBS_UNAVAILABLE = "jobs_unavailable", (503,), False, (
        "the JobManager cannot answer (not deployed, did not answer in time, or gone)")
    STATE_UNAVAILABLE = "state_unavailable", (503,), False, "the state database cannot be reached"
    STORAGE_UNAVAILABLE = "storage_unavailable", (503,), False, (
        "the artifact store (the state dir or an S3 bucket) cannot be reached")
    # -- 507
    SESSION_CACHE_FULL = "session_cache_full", (507,), False, (
        "the session would need more KV blocks than one rank's whole cache (`session_cache_bytes`) holds, "
        "even with every other session evicted; nothing was appended")
    # -- 504
    DEADLINE_EXCEEDED = "deadline_exceeded", (504,), False, (
        "the request's own deadline passed (`X-Request-Timeout-Seconds`, OIP `parameters.timeout`, else "
        "`request_timeout_s`: see [Deadlines and retries](operations.md#deadlines-and-retries))")
    COLLECTIVE_TIMEOUT = "collective_timeout", (504,), True, (
        "a collective did not finish within `collective_timeout_s` (a rank is stuck); the gang is rebuilt")
    GANG_TIMEOUT = "gang_timeout", (504,), False, "the gang server did not answer a call within its timeout"


_BY_WIRE: dict[str, ErrorCode] = {code.value: code for code in ErrorCode}

# What the ingress may retry a request through; each call declares which of them it retries
# (service.ingress.retries.RETRY_TABLE).
RETRYABLE_CODES: frozenset[ErrorCode] = frozenset(code for code in ErrorCode if code.retryable)

# A gang that is not ready answers with the code of its state (keyed by the state enums of
# service.contract.gang_status, their one definition).
_GANG_STATE_CODES: dict[AnyState, ErrorCode] = {
    GangState.STARTING: ErrorCode.GANG_STARTING, GangState.BROKEN: ErrorCode.GANG_BROKEN,
    GangState.REBUILDING: ErrorCode.GANG_REBUILDING, GangState.STOPPED: ErrorCode.GANG_STOPPED,
    AbsentState.SCHEDULING: ErrorCode.GANG_SCHEDULING, AbsentState.UNSCHEDULABLE: ErrorCode.UNSCHEDULABLE,
    ObservedState.UNREACHABLE: ErrorCode.GANG_UNREACHABLE,
}


def gang_state_code(state: AnyState) -> ErrorCode:
    """The code a gang in `state` answers a request with: `gang_<state>` for a state that
    does not serve; `gang_unavailable` for `ready` (which serves: a request that got it
    anyway met a gang that changed meanwhile)."""
    return _GANG_STATE_CODES.get(state, ErrorCode.GANG_UNAVAILABLE)


def error_table_markdown() -> str:
    """docs/api.md's error table: one row per code, by status (the registry's order within one)."""
    def status_of(code: ErrorCode) -> str:
        return ", ".join(str(s) for s in code.statuses) or "any"

    rows = sorted(ErrorCode, key=lambda c: c.statuses[0] if c.statuses else 999)
    lines = ["| status | code | retried | when |", "|---|---|---|---|"]
    lines += [f"| {status_of(c)} | `{c.value}` | {'yes' if c.retryable else ''} | {c.meaning} |" for c in rows]
    return "\n".join(lines) + "\n"


TABLE_BEGIN = "<!-- error table: generated from service/contract/errors.py by `make docs`; do not edit -->"
TABLE_END = "<!-- end of the error table -->"


def with_error_table(document: str) -> str:
    """`document` with the text between TABLE_BEGIN and TABLE_END replaced by the current table."""
    head, begin, rest = document.partition(TABLE_BEGIN)
    _, end, tail = rest.partition(TABLE_END)
    if not begin or not end:
        raise ValueError(f"the document has no {TABLE_BEGIN!r} ... {TABLE_END!r} section")
    return f"{head}{TABLE_BEGIN}\n{error_table_markdown()}{TABLE_END}{tail}"


def describe_validation_errors(errors: Sequence[Any], where: str = "body", limit: int = 5,
                               msg_chars: int = 120) -> str:
    """pydantic/FastAPI validation errors as 'loc: msg; ...' for an error reply.

    At most `limit` problems, each location cut short and each message cut at `msg_chars`,
    and never the input itself (it may be huge or secret); `where` names an error with an
    empty location.
    """
    problems = []
    for error in list(errors)[:limit]:
        loc = ".".join(str(part) for part in error.get("loc", ()))[:80] or where
        problems.append(f"{loc}: {str(error.get('msg', 'invalid'))[:msg_chars]}")
    more = len(errors) - len(problems)
    return "; ".join(problems) + (f" (and {more} more)" if more > 0 else "")


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message`, cut to at most `limit` characters (marked with '...')."""
    message = str(message)
    return message if len(message) <= limit else message[: limit - 3] + "..."


class GangServeError(Exception):
    """Base: a message for humans, a stable machine code (an ErrorCode), an HTTP status.

    A subclass names its `code`; its `status` is that code's usual one unless it sets its own.
    A `code=` given to one error changes the code only, never the status.
    """

    status: int = 500
    code: ErrorCode | str = ErrorCode.INTERNAL  # a str only for a code from elsewhere (error_from_wire)
    retry_after_s: float | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "status" not in cls.__dict__ and isinstance(cls.__dict__.get("code"), ErrorCode):
            cls.status = cls.__dict__["code"].status

    def __init__(self, message: str, *, code: ErrorCode | str | None = None,
                 retry_after_s: float | None = None) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = _BY_WIRE.get(str(code), code)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:  # keep code/retry_after_s across pickling (Ray)
        return (_rebuild, (type(self), self.message, self.code, self.retry_after_s))


def _rebuild(cls: type[GangServeError], message: str, code: str, retry_after_s: float | None) -> GangServeError:
    return cls(message, code=code, retry_after_s=retry_after_s)


class BadRequest(GangServeError):
    """Malformed body: cannot be parsed at all."""

    code = ErrorCode.MALFORMED


class Unauthorized(GangServeError):
    """Missing or wrong bearer token on a route that needs one."""

    code = ErrorCode.UNAUTHORIZED


class NotFound(GangServeError):
    code = ErrorCode.NOT_FOUND


class Conflict(GangServeError):
    """The request is valid but does not fit the current state (e.g. a checkpoint of another shape)."""

    code = ErrorCode.CONFLICT


class NotAcceptable(GangServeError):
    code = ErrorCode.NOT_ACCEPTABLE


class PayloadTooLarge(GangServeError):
    code = ErrorCode.BODY_TOO_LARGE


class UnsupportedMediaType(GangServeError):
    code = ErrorCode.UNSUPPORTED_MEDIA_TYPE


class InvalidInput(GangServeError):
    """Parsed, but the wrong shape, dtype, name or values."""

    code = ErrorCode.INVALID_INPUT


class GangUnavailable(GangServeError):
    """The gang cannot serve right now (starting, rebuilding, unschedulable, a rank died)."""

    code = ErrorCode.GANG_UNAVAILABLE
    retry_after_s = 5.0


class Overloaded(GangServeError):
    """Too much work in flight (e.g. the ingress's bounded decoding pool is full); retry later."""

    code = ErrorCode.OVERLOADED
    retry_after_s = 1.0


class CollectiveTimeout(GangServeError):
    """A collective did not finish within the per-request deadline."""

    code = ErrorCode.COLLECTIVE_TIMEOUT


class DeadlineExceeded(GangServeError):
    """The request's own deadline (X-Request-Timeout-Seconds, OIP `parameters.timeout`, or the
    builder's `request_timeout_s`) passed before its answer was ready (service.contract.deadlines)."""

    code = ErrorCode.DEADLINE_EXCEEDED


class DeadlineExceededBeforeStep(DeadlineExceeded):
    """The deadline passed before the request's gang step started: it was never computed."""


class SessionGone(GangServeError):
    """The gang that held a session is gone (410 `session_lost`)."""

    code = ErrorCode.SESSION_LOST


class TooManySessions(GangServeError):
    """`max_sessions` sessions are open (429 with Retry-After)."""

    code = ErrorCode.TOO_MANY_SESSIONS
    retry_after_s = 5.0


class SessionCacheFull(GangServeError):
    """A session that cannot fit one rank's KV cache (507)."""

    code = ErrorCode.SESSION_CACHE_FULL
    retry_after_s = 30.0


class GangStartupError(GangServeError):
    """Bring-up failed in a named stage; the message says which and why."""

    code = ErrorCode.GANG_STARTUP_FAILED
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


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m service.contract.errors` prints the error table; `--update FILE` writes it into FILE
    between its markers (docs/api.md)."""
    parser = argparse.ArgumentParser(prog="python -m service.contract.errors", description=main.__doc__)
    parser.add_argument("--update", type=Path, metavar="FILE", help="rewrite FILE's error table in place")
    args = parser.parse_args(argv)
    if args.update is None:
        sys.stdout.write(error_table_markdown())
        return 0
    args.update.write_text(with_error_table(args.update.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
