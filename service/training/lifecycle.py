"""The rules of a job's life after submit: what its manager does with one job, given the
job's record and what the cluster says about its run.

Pure: no I/O, no Ray, no clock (the caller passes `now`). Each function is one rule and
returns a decision; service.training.jobs.Jobs reads the inputs and carries the decision
out. The rules (docs/training.md, *Lifecycle*):

- `before_poll`: a job no longer active or no longer this manager's is not polled again
  (its run is killed when the job ended or is gone); a job past its wall-clock limit is
  stopped and FAILED.
- `after_poll`: the run's answer to a poll (`Answered`, `TimedOut`, `ActorDied`): persist
  it, count a missed poll (FAIL after `max_missed_polls` in a row), or settle a run that is
  gone. A run that ended is released; a PENDING one has its placement checked.
- `pending_check`: a PENDING job the cluster can never hold, or one waiting past its
  `schedule_timeout_s`, is stopped and FAILED; else its `reason` follows the cluster.
- `snapshot_changes`: which record fields a snapshot changes; a status the transition table
  (service.training.status) refuses is not written, the rest is.
- `adoption`: an adopted job whose run actor still exists is re-attached; else its run is gone.
- `settle_gone_run`: a run that is gone and left no outcome is started again (resumed), at
  most `max_resumes` times per job, then the job FAILS; a job that ended or moved to another
  manager meanwhile is left as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.training.run_snapshot import Progress, ResumeState, RunSnapshot
from service.training.spec import JobSpec
from service.training.status import TERMINAL, JobStatus, can_move
from service.training.store import JobRecord
from service.config.tunables import TrainingTunables


@dataclass(frozen=True)
class Rules:
    """The rules' budgets (service.config.tunables.TrainingTunables says why each value)."""

    max_missed_polls: int
    max_resumes: int

    @classmethod
    def of(cls, tunables: TrainingTunables) -> Rules:
        return cls(max_missed_polls=tunables.max_missed_polls, max_resumes=tunables.max_resumes)


# ---- what the cluster says about a run ---------------------------------------------------------

@dataclass(frozen=True)
class Answered:
    """The run actor answered the poll with this snapshot (service.training.run.TrainRun.snapshot)."""

    snapshot: RunSnapshot


@dataclass(frozen=True)
class TimedOut:
    """The run actor did not answer within the poll's bound."""


@dataclass(frozen=True)
class ActorDied:
    """The run actor is dead (`error`: the exception's type name)."""

    error: str


Observation = Answered | TimedOut | ActorDied


@dataclass(frozen=True)
class Placement:
    """What the cluster says about a PENDING job's workers: why it can never hold them
    (`infeasible`, None if it can) and what they wait for now (`waiting`)."""

    infeasible: str | None
    waiting: str


# ---- decisions ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Untrack:
    """Stop polling the job; `kill`: its record ended or is gone, so its run must go too."""

    kill: bool


@dataclass(frozen=True)
class Fail:
    """FAIL the job with `error`; `kill`: stop its run first (False: the run is gone already)."""

    error: str
    kill: bool = True


@dataclass(frozen=True)
class Missed:
    """The poll went unanswered; `count` in a row now. Keep polling."""

    count: int


@dataclass(frozen=True)
class RunGone:
    """The run actor is gone: take its outcome, or resume the run, or FAIL (`settle_gone_run`)."""

    why: str


@dataclass(frozen=True)
class Apply:
    """Persist the snapshot (`snapshot_changes`); then `release` the run (it ended: kill its
    actor, the outcome is recorded) or `check_pending` (it still waits for its workers)."""

    release: bool = False
    check_pending: bool = False


@dataclass(frozen=True)
class SetReason:
    """The PENDING job's `reason` is now `reason`."""

    reason: str


@dataclass(frozen=True)
class Keep:
    """Nothing to do."""


@dataclass(frozen=True)
class Reattach:
    """The adopted job's run is alive: poll it."""


@dataclass(frozen=True)
class Resume:
    """Start a new run of the job (its first worker group resumes from the run's newest
    registered epoch checkpoint); `resumes`: the job's count including this one."""

    resumes: int


@dataclass(frozen=True)
class Changes:
    """What a snapshot changes in the record: `fields` to write, and `refused` (the run's
    status the transition table refused; the stored status stays), if any."""

    fields: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None


# ---- the rules ---------------------------------------------------------------------------------

def over_runtime(record: JobRecord, service_max_runtime_s: float, now: float) -> str | None:
    """Why an active job must stop for its wall clock (since submission), or None. The job's
    own limit applies, never above the service's (which may have been lowered since)."""
    limit = min(record.spec.get("max_runtime_s") or service_max_runtime_s, service_max_runtime_s)
    took = now - record.created_at
    if took <= limit:
        return None
    return (f"exceeded max_runtime_s={limit:g}: {took:.0f}s since submission, still {record.status} "
            f"(epoch {record.progress.get('epoch', 0)}/{record.progress.get('epochs', '?')})")


def before_poll(record: JobRecord | None, manager: str, service_max_runtime_s: float,
                now: float) -> Untrack | Fail | None:
    """Before asking the run: `record` as stored now (None: deleted). None means poll it."""
    if record is None or not record.active or record.owner != manager:
        # Ended elsewhere (cancelled, adopted): stop polling; a run whose job ended must be gone.
        return Untrack(kill=record is None or record.status in TERMINAL)
    over = over_runtime(record, service_max_runtime_s, now)
    if over:
        return Fail(over)
    return None


def after_poll(observation: Observation, missed_polls: int, rules: Rules) -> Apply | Missed | Fail | RunGone:
    """What the run's answer means; `missed_polls`: unanswered polls in a row before this one."""
    if isinstance(observation, TimedOut):
        missed = missed_polls + 1
        if missed >= rules.max_missed_polls:
            return Fail(f"the run actor did not answer {rules.max_missed_polls} polls in a row; stopped it")
        return Missed(missed)
    if isinstance(observation, ActorDied):
        return RunGone(f"the run's actor died ({observation.error})")
    status = observation.snapshot.status
    return Apply(release=status in TERMINAL, check_pending=status == JobStatus.PENDING)


def pending_check(record: JobRecord, spec: JobSpec, placement: Placement, now: float) -> Fail | SetReason | Keep:
    """A PENDING job: FAIL it if the cluster can never hold it or it waited longer than its
    `schedule_timeout_s` since submission; else keep its `reason` current."""
    why_not = placement.infeasible
    if why_not is None and now - record.created_at > spec.schedule_timeout_s:
        why_not = f"not scheduled within schedule_timeout_s={spec.schedule_timeout_s:g}: still {placement.waiting}"
    if why_not:
        return Fail(why_not)
    if placement.waiting != record.reason:
        return SetReason(placement.waiting)
    return Keep()


def snapshot_changes(record: JobRecord, snapshot: RunSnapshot) -> Changes:
    """The record fields `snapshot` (a poll's, or a finished run's result.json) changes. A
    status move the table refuses (e.g. RUNNING back to PENDING) is dropped and named in
    `refused` (the store would refuse the whole update); a job no longer PENDING loses its
    "waiting ..." reason."""
    fields = {key: value for key, value in snapshot.record_fields().items() if value != getattr(record, key)}
    refused = None
    if "status" in fields and not can_move(record.status, fields["status"]):
        refused = fields.pop("status")
    if snapshot.status != JobStatus.PENDING and record.reason and record.reason.startswith("waiting"):
        fields["reason"] = None
    return Changes(fields, refused)


def adoption(actor_found: bool) -> Reattach | RunGone:
    """A job this manager just adopted (its manager died): its run actor still exists or not."""
    return Reattach() if actor_found else RunGone("service restarted")


def settle_gone_run(current: JobRecord | None, manager: str, why: str, rules: Rules) -> Keep | Fail | Resume:
    """A run that is gone and left no result.json (a run that left one has its outcome
    applied instead); `current`: the job's record as stored now (None: deleted)."""
    if current is None or not current.active or current.owner != manager:
        return Keep()  # cancelled, deleted or adopted by another manager meanwhile
    if current.resumes >= rules.max_resumes:
        return Fail(f"{why} while the job was {current.status}; its run is gone and was "
                    f"already resumed {current.resumes} time(s) (limit {rules.max_resumes})", kill=False)
    return Resume(current.resumes + 1)


def resume_state(record: JobRecord) -> ResumeState:
    """What a resumed run starts from (service.training.run.TrainRun's `resume`)."""
    return ResumeState(attempts=record.attempts, started_at=record.started_at, progress=Progress.of(record.progress),
                       resumed_from_epoch=record.resumed_from_epoch)
