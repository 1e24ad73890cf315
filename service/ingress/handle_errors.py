"""One mapping from what a Serve handle call can raise to a GangServeError.

Both of the ingress's handle clients (GangServerCalls -> GangServer, JobsClient -> JobManager)
use it, so a deployment's failure reads the same way whichever deployment it was:

    RayTaskError whose cause is a GangServeError  -> that error, code and Retry-After intact
    RayTaskError (anything else)                  -> 503 "<what> failed (<type>)", traceback logged
    BackPressureError                             -> 503 overloaded, Retry-After 1 s
    RayActorError                                 -> 503 "<what> replica is gone"
    any other RayError / RayServeException        -> 503 "<what> could not be reached"

Never a 500: whatever happens between the ingress and a deployment, the deployment is
unavailable right now, and the client may retry.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException

from service.contract.deadlines import bounded
from service.contract.errors import ErrorCode, GangServeError, GangUnavailable

log = logging.getLogger("gangserve.ingress")

# (message, code, retry_after_s) -> the error to raise
Unavailable = Callable[[str, ErrorCode, "float | None"], GangServeError]

# A deployment's failures by the first word of its `what`: (failed, replica gone, unreachable).
# The job manager's are replaced by jobs_unavailable (service.ingress.jobs_client).
_PEER_CODES: dict[str, tuple[ErrorCode, ErrorCode, ErrorCode]] = {
    "gang": (ErrorCode.GANG_ERROR, ErrorCode.GANG_RESTARTING, ErrorCode.GANG_UNREACHABLE),
    "controller": (ErrorCode.CONTROLLER_ERROR, ErrorCode.CONTROLLER_RESTARTING, ErrorCode.CONTROLLER_UNREACHABLE),
}
_OTHER_PEER = (ErrorCode.GANG_UNAVAILABLE,) * 3


def gang_unavailable(message: str, code: ErrorCode, retry_after_s: float | None) -> GangServeError:
    """The default `Unavailable`: a 503 GangUnavailable with that code and Retry-After."""
    return GangUnavailable(message, code=code, retry_after_s=retry_after_s)


async def awaited(response: Any) -> Any:
    """A coroutine awaiting a DeploymentResponse (asyncio.wait_for and tasks need one)."""
    return await response


async def bounded_call(handle: Any, method: str, *args: Any, what: str, timeout_s: float,
                       unavailable: Unavailable = gang_unavailable, timeout_code: ErrorCode | None = None,
                       **kwargs: Any) -> Any:
    """`handle.method.remote(*args, **kwargs)`, awaited for at most `timeout_s`: its result,
    or a GangServeError. Past `timeout_s` the call is cancelled and `unavailable` says so
    (`timeout_code`, default the peer's "unreachable" code, Retry-After 1 s); every other
    failure goes through `map_handle_error`."""
    response = getattr(handle, method).remote(*args, **kwargs)
    try:
        return await bounded(awaited(response), until=time.monotonic() + timeout_s, on_cancel=response.cancel,
                             timed_out=lambda: unavailable(f"the {what} did not answer {method} within {timeout_s:g}s",
                                                           timeout_code or _codes(what)[2], 1.0))
    except Exception as exc:  # the bound's own error comes back out of map_handle_error as it is
        error = map_handle_error(exc, what=what, method=method, unavailable=unavailable)
        if error is None:
            raise
        raise error from None


def map_handle_error(
    exc: BaseException, *, what: str, method: str, unavailable: Unavailable = gang_unavailable,
    passthrough: tuple[type[BaseException], ...] = (),
) -> BaseException | None:
    """The error to raise for `exc` raised by `what`.`method`, or None if `exc` is not a
    handle-call failure (the caller re-raises it as is).

    `passthrough` lists further exception types that a deployment raises on purpose and
    the caller handles itself (they come back out of a RayTaskError's `cause` unchanged).
    """
    if isinstance(exc, RayTaskError):
        # Before GangServeError: Ray re-raises a task's exception as a dual class that is
        # also an instance of the cause's type, but without the cause's code/retry_after_s.
        cause = getattr(exc, "cause", None)
        if isinstance(cause, (GangServeError, *passthrough)):
            return cause
        log.error("%s call %s failed: %s", what, method, exc)  # the traceback stays in the log
        return unavailable(f"the {what} failed ({type(cause or exc).__name__}); see the service log",
                           _codes(what)[0], None)
    if isinstance(exc, GangServeError):
        return exc
    if isinstance(exc, BackPressureError):
        return unavailable(f"the {what} is overloaded: {exc}", ErrorCode.OVERLOADED, 1.0)
    if isinstance(exc, RayActorError):
        return unavailable(f"the {what} replica is gone ({type(exc).__name__}); Serve is restarting it",
                           _codes(what)[1], None)
    if isinstance(exc, (RayError, RayServeException)):
        log.warning("%s call %s failed: %s: %s", what, method, type(exc).__name__, exc)
        return unavailable(f"the {what} could not be reached ({type(exc).__name__})",
                           _codes(what)[2], None)
    return None


def _codes(what: str) -> tuple[ErrorCode, ErrorCode, ErrorCode]:
    """'gang server' -> gang_error, gang_restarting, gang_unreachable (the codes clients know)."""
    return _PEER_CODES.get(what.split()[0], _OTHER_PEER)
