"""How the gang classifies what went wrong with a rank: the one place that reads errors.

Imports no Ray at module level: the plain rank (service.gang.worker, which runs without
Ray in the GPU check) raises `WeightsVersionMismatch` and uses `first_line` from here.

A peer's failure reaches rank 0 as a Ray error (its task raised, its process died, a bounded
`ray.get` ran out) or as the process group's own RuntimeError. What the caller is told
depends on which: 504 when something ran out of time (a rank is stuck), 503 when a rank
failed, and a refusal when a rank held another weights version than the step expected.
"""
from __future__ import annotations

from typing import Any


class WeightsVersionMismatch(RuntimeError):
    """A step expected another weights version than the one this rank holds: raised by
    the refusing rank (service.gang.worker), returned to rank 0 by `step_error`, and read
    here by type (`is_version_mismatch`) whichever process raised it."""


class PeerCallFailed(RuntimeError):
    """A lifecycle call to the peers (service.gang.peers) failed on some ranks: the message
    names the stage and, per rank, why; `failed` the ranks, `late` those that did not
    answer in time (all of them late: the call ran out of time, a 504 where it matters)."""

    def __init__(self, message: str, stage: str, failed: list[int], late: list[int]) -> None:
        super().__init__(message)
        self.stage, self.failed, self.late = stage, failed, late

    @property
    def timed_out(self) -> bool:
        return bool(self.late) and self.late == self.failed


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (at most 300 characters), else its type's name."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def cause(exc: BaseException) -> BaseException:
    """The exception a Ray task raised (RayTaskError wraps it), else exc itself."""
    return getattr(exc, "cause", None) or exc


def is_version_mismatch(exc: BaseException) -> bool:
    return isinstance(cause(exc), WeightsVersionMismatch)


def is_timeout(exc: BaseException) -> bool:
    """504 (a collective or a peer's ack ran out of time) vs 503 (a rank failed).

    Decided by type wherever a type exists: Ray's GetTimeoutError (a bounded ray.get on
    the peers' acks), Python's TimeoutError and a PeerCallFailed whose every failed rank
    was late mean out of time; RayActorError means a peer process died. The collective's own failure has no distinguishing type: with
    torch 2.13, gloo raises a plain RuntimeError both for its timeout ("Timed out waiting
    2000ms for recv operation to complete", then "Application timeout caused pair
    closure") and for a dead peer ("Connection closed by peer"), and NCCL raises
    DistBackendError for both as well (checked with a 2-process gloo group). Only there
    the first line of the error's own message decides, never a RayTaskError's rendered
    traceback (its source lines can contain "timeout" whatever happened).
    """
    from ray.exceptions import GetTimeoutError, RayActorError  # here: the ranks import this module without Ray

    inner = cause(exc)
    for e in (exc, inner):
        if isinstance(e, PeerCallFailed):
            return e.timed_out
        if isinstance(e, (GetTimeoutError, TimeoutError)):
            return True
        if isinstance(e, RayActorError):
            return False
    if not isinstance(inner, RuntimeError):  # torch.distributed.DistError subclasses RuntimeError
        return False
    text = first_line(inner).lower()
    return "timed out" in text or "timeout" in text


def kill_quietly(actor: Any) -> None:
    """ray.kill without restart; an actor that is already gone is not an error."""
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already dead
        pass
