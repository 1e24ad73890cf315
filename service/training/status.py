"""A training job's status and the moves between statuses: the one table every writer obeys.

    PENDING ──> RUNNING ──> SUCCEEDED | FAILED | CANCELLED
       └──────────────────> SUCCEEDED | FAILED | CANCELLED

- PENDING: the record is written and its run actor created; its worker group waits for room.
- RUNNING: a worker entered the train loop (a resumed run of a RUNNING job stays RUNNING).
- SUCCEEDED | FAILED | CANCELLED: terminal; nothing moves a job out of them.

PENDING may end without passing RUNNING: it is CANCELLED or FAILED (never scheduled), and
the poller may first see a run after it already finished (SUCCEEDED). RUNNING never goes
back to PENDING. An active status may "move" to itself: an update of other fields (progress,
reason) keeps it.

`can_move` and `check_transition` answer for one move; `sources(to)` is the statuses from
which `to` may be written, which the job store turns into its atomic
`UPDATE ... WHERE status IN (...)` (the guard that makes concurrent writers safe: a late
progress update cannot undo a cancel). Plain Python, no imports from the rest of the
service: the ingress reads it too (service.training.public).
"""
from __future__ import annotations

from enum import StrEnum

from service.contract.errors import Conflict, ErrorCode


class JobStatus(StrEnum):
    """A job's status; a str, so it compares equal to its name and JSON-encodes as it."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def active(self) -> bool:
        return self in ACTIVE


ACTIVE: tuple[JobStatus, ...] = (JobStatus.PENDING, JobStatus.RUNNING)
TERMINAL: tuple[JobStatus, ...] = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)

# from -> the statuses it may be written as (itself included for the active ones: an update
# of other fields). Terminal statuses have no move at all.
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.PENDING: frozenset({JobStatus.PENDING, JobStatus.RUNNING, *TERMINAL}),
    JobStatus.RUNNING: frozenset({JobStatus.RUNNING, *TERMINAL}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


class IllegalTransition(Conflict):
    """409 illegal_transition: a write asked for a move the table refuses."""

    def __init__(self, frm: JobStatus, to: JobStatus, job_id: str | None = None) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[frm])) or "none: it is terminal"
        what = f"job {job_id}" if job_id else "a job"
        super().__init__(f"{what} cannot move from {frm} to {to} (allowed from {frm}: {allowed})",
                         code=ErrorCode.ILLEGAL_TRANSITION)
        self.frm, self.to = frm, to


def parse(value: str | JobStatus) -> JobStatus:
    """The JobStatus named `value`; ValueError naming the valid ones otherwise."""
    try:
        return JobStatus(value)
    except ValueError:
        raise ValueError(f"unknown job status {value!r}; valid: {', '.join(JobStatus)}") from None


def can_move(frm: str | JobStatus, to: str | JobStatus) -> bool:
    """Whether a job in `frm` may be written as `to`."""
    return parse(to) in TRANSITIONS[parse(frm)]


def check_transition(frm: str | JobStatus, to: str | JobStatus, job_id: str | None = None) -> JobStatus:
    """`to` as a JobStatus if the move is allowed, else IllegalTransition (409)."""
    frm_s, to_s = parse(frm), parse(to)
    if to_s not in TRANSITIONS[frm_s]:
        raise IllegalTransition(frm_s, to_s, job_id)
    return to_s


def sources(to: str | JobStatus) -> tuple[JobStatus, ...]:
    """The statuses from which a job may be written as `to` (in declaration order)."""
    to_s = parse(to)
    return tuple(s for s in JobStatus if to_s in TRANSITIONS[s])
