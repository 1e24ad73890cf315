"""The rules of a job's life after submit (service.training.lifecycle), as tables: each row
is a job record and what the cluster says about its run, and the decision the rule makes.
Pure functions: no Ray, no database, no clock."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from service.training.lifecycle import (
    ActorDied,
    Answered,
    Apply,
    Changes,
    Fail,
    Keep,
    Missed,
    Placement,
    Reattach,
    Resume,
    Rules,
    RunGone,
    SetReason,
    TimedOut,
    Untrack,
    adoption,
    after_poll,
    before_poll,
    over_runtime,
    pending_check,
    resume_state,
    settle_gone_run,
    snapshot_changes,
)
from service.training.run_snapshot import (
    EpochEntry, FinalCheckpoint, LogLine, Progress, ResumeState, RunSnapshot, WorkerEntry,
)
from service.training.spec import JobSpec
from service.training.status import JobStatus
from service.training.store import JobRecord
from service.config.tunables import TrainingTunables

pytestmark = pytest.mark.unit

ME = "mgr-me"
RULES = Rules(max_missed_polls=3, max_resumes=2)
T0 = 1_000.0  # every job below was submitted at T0


def job(status: str = "RUNNING", *, owner: str | None = ME, **kw: Any) -> JobRecord:
    spec = kw.pop("spec", {})
    return JobRecord(id="job-0", status=status, spec=spec, created_at=T0, updated_at=T0,
                     progress=kw.pop("progress", {"epoch": 2, "epochs": 5, "step": 7, "loss": None}), owner=owner, **kw)


def snapshot_of(record: JobRecord, **moved: Any) -> RunSnapshot:
    """The whole snapshot a run of `record` answers when only `moved` changed since the record
    was written (a run always sends every field)."""
    p = record.progress
    return dataclasses.replace(RunSnapshot(
        status=JobStatus(record.status), error=record.error, started_at=record.started_at,
        finished_at=record.finished_at, progress=Progress(p["epoch"], p["epochs"], p["step"], p["loss"]),
        workers=tuple(WorkerEntry(**w) for w in record.workers), attempts=record.attempts,
        resumed_from_epoch=record.resumed_from_epoch,
        checkpoint=FinalCheckpoint(**record.checkpoint) if record.checkpoint else None), **moved)


def test_the_rules_default_to_the_tunables() -> None:
    t = TrainingTunables(max_missed_polls=7, max_resumes=2)
    assert Rules.of(t) == Rules(7, 2)


# ---- before_poll: whose job, and within its wall clock -------------------------------------------

@pytest.mark.parametrize(("record", "now", "decision"), [
    (None, T0, Untrack(kill=True)),                                  # deleted: its run must go
    (job("CANCELLED"), T0, Untrack(kill=True)),                      # ended elsewhere
    (job("SUCCEEDED"), T0, Untrack(kill=True)),
    (job("FAILED", owner="mgr-other"), T0, Untrack(kill=True)),
    (job("RUNNING", owner="mgr-other"), T0, Untrack(kill=False)),    # adopted by another manager: its run lives
    (job("PENDING", owner="mgr-other"), T0, Untrack(kill=False)),
    (job("RUNNING"), T0 + 100, None),                                # ours, in time: poll it
    (job("PENDING"), T0 + 100, None),
    (job("RUNNING"), T0 + 3600, None),                               # exactly at the limit: still in time
    (job("RUNNING"), T0 + 3601, Fail("exceeded max_runtime_s=3600: 3601s since submission, still RUNNING "
                                     "(epoch 2/5)")),
    (job("PENDING", progress={}), T0 + 4000, Fail("exceeded max_runtime_s=3600: 4000s since submission, "
                                                  "still PENDING (epoch 0/?)")),
])
def test_before_poll(record: JobRecord | None, now: float, decision: Any) -> None:
    assert before_poll(record, ME, 3600.0, now) == decision


@pytest.mark.parametrize(("own", "service", "took", "limit"), [
    (None, 3600.0, 3601, 3600),    # no limit of its own: the service's
    (60.0, 3600.0, 61, 60),        # its own, lower
    (7200.0, 3600.0, 3601, 3600),  # its own, above the service's (lowered since): the service's
])
def test_the_runtime_limit_is_the_jobs_own_never_above_the_services(
        own: float | None, service: float, took: float, limit: float) -> None:
    record = job(spec={"max_runtime_s": own})
    assert over_runtime(record, service, T0 + took - 1) is None
    error = over_runtime(record, service, T0 + took)
    assert error is not None and error.startswith(f"exceeded max_runtime_s={limit:g}: {took:.0f}s since submission")


# ---- after_poll: what the run said ---------------------------------------------------------------

@pytest.mark.parametrize(("seen", "missed", "decision"), [
    (Answered(RunSnapshot(JobStatus.RUNNING)), 0, Apply()),
    (Answered(RunSnapshot(JobStatus.RUNNING)), 2, Apply()),          # an answer resets the count (the caller)
    (Answered(RunSnapshot(JobStatus.PENDING)), 0, Apply(check_pending=True)),
    (Answered(RunSnapshot(JobStatus.SUCCEEDED)), 0, Apply(release=True)),
    (Answered(RunSnapshot(JobStatus.FAILED)), 0, Apply(release=True)),
    (Answered(RunSnapshot(JobStatus.CANCELLED)), 0, Apply(release=True)),
    (TimedOut(), 0, Missed(1)),
    (TimedOut(), 1, Missed(2)),
    (TimedOut(), 2, Fail("the run actor did not answer 3 polls in a row; stopped it")),
    (ActorDied("ActorDiedError"), 0, RunGone("the run's actor died (ActorDiedError)")),
    (ActorDied("ActorUnavailableError"), 2, RunGone("the run's actor died (ActorUnavailableError)")),
])
def test_after_poll(seen: Any, missed: int, decision: Any) -> None:
    assert after_poll(seen, missed, RULES) == decision


# ---- pending_check: can it ever start, and has it waited too long ---------------------------------

WAITING = "waiting for 2 x {CPU: 0.5} (PACK); free now: 0 CPU on 0 nodes (1 alive node)"
NEVER = "the cluster can never hold this job: ..."


@pytest.mark.parametrize(("reason", "placement", "waited", "decision"), [
    (WAITING, Placement(None, WAITING), 10, Keep()),
    ("waiting for something else", Placement(None, WAITING), 10, SetReason(WAITING)),
    (None, Placement(None, WAITING), 10, SetReason(WAITING)),
    (WAITING, Placement(NEVER, WAITING), 10, Fail(NEVER)),                 # a node left: never
    (WAITING, Placement(None, WAITING), 300, Keep()),                      # at its schedule_timeout_s: in time
    (WAITING, Placement(None, WAITING), 301,
     Fail(f"not scheduled within schedule_timeout_s=300: still {WAITING}")),
    (WAITING, Placement(NEVER, WAITING), 301, Fail(NEVER)),                # infeasible says more than late
])
def test_pending_check(reason: str | None, placement: Placement, waited: float, decision: Any) -> None:
    record = job("PENDING", reason=reason, spec={"schedule_timeout_s": 300})
    spec = JobSpec.model_validate(record.spec)
    assert pending_check(record, spec, placement, T0 + waited) == decision


# ---- snapshot_changes: what a snapshot writes ----------------------------------------------------

CHECKPOINT = FinalCheckpoint(path="checkpoints/job-0.safetensors", url="/train/job-0/checkpoint",
                             format="dense-attention", bytes=1234)


@pytest.mark.parametrize(("record", "moved", "changes"), [
    (job("RUNNING", attempts=1), {}, Changes({})),
    (job("RUNNING", attempts=1),
     {"attempts": 2, "logs": (LogLine(1, T0, "x"),), "history": (EpochEntry(1, 0.5),), "history_seq": 1},
     Changes({"attempts": 2})),                                          # only fields that changed, only record fields
    (job("RUNNING"), {"progress": Progress(3, 5, 9, 0.25)},
     Changes({"progress": {"epoch": 3, "epochs": 5, "step": 9, "loss": 0.25}})),  # as the record stores it
    (job("PENDING", reason=WAITING), {"status": JobStatus.RUNNING, "started_at": 5.0},
     Changes({"status": "RUNNING", "started_at": 5.0, "reason": None})),  # no longer waiting
    (job("PENDING", reason=WAITING), {}, Changes({})),
    (job("RUNNING", reason="resumed"), {"status": JobStatus.SUCCEEDED, "checkpoint": CHECKPOINT},
     Changes({"status": "SUCCEEDED", "checkpoint": dataclasses.asdict(CHECKPOINT)})),  # a reason not "waiting" stays
    (job("RUNNING", attempts=1), {"status": JobStatus.PENDING, "attempts": 2},
     Changes({"attempts": 2}, refused="PENDING")),                       # RUNNING never returns to PENDING
    (job("CANCELLED"), {"status": JobStatus.SUCCEEDED}, Changes({}, refused="SUCCEEDED")),
])
def test_snapshot_changes(record: JobRecord, moved: dict[str, Any], changes: Changes) -> None:
    assert snapshot_changes(record, snapshot_of(record, **moved)) == changes


def test_a_result_json_reads_back_as_the_snapshot_written() -> None:
    """The outcome a run leaves in its run dir (to_json) is what a manager reads (from_json),
    every field; one written with the log lines as lists (the earlier layout) reads too."""
    full = RunSnapshot(
        status=JobStatus.SUCCEEDED, error=None, started_at=T0 + 1, finished_at=T0 + 9,
        progress=Progress(2, 2, 8, 0.125), history=(EpochEntry(1, 0.5, 0.6, T0 + 4), EpochEntry(2, 0.125, None, T0 + 8)),
        history_seq=2, workers=(WorkerEntry(0, 11, "node-a", "10.0.0.1", "eth0", 1),
                                WorkerEntry(1, 12, "node-b", None, None, 1)),
        attempts=1, resumed_from_epoch=None, checkpoint=CHECKPOINT, logs=(LogLine(1, T0 + 2, "run started"),))
    assert RunSnapshot.from_json(full.to_json()) == full
    earlier = (b'{"status": "FAILED", "error": "boom", "progress": {"epoch": 1, "epochs": 3, "step": 5, "loss": 1.0},'
               b' "logs": [[3, 1000.5, "training failed"]], "attempts": 1}')
    assert RunSnapshot.from_json(earlier) == RunSnapshot(
        status=JobStatus.FAILED, error="boom", progress=Progress(1, 3, 5, 1.0), attempts=1,
        logs=(LogLine(3, 1000.5, "training failed"),))
    with pytest.raises(ValueError, match="not a run snapshot"):
        RunSnapshot.from_json(b'{"error": "no status"}')


# ---- adoption and runs that are gone ---------------------------------------------------------------

def test_adoption() -> None:
    assert adoption(actor_found=True) == Reattach()
    assert adoption(actor_found=False) == RunGone("service restarted")


@pytest.mark.parametrize(("current", "decision"), [
    (job("RUNNING", resumes=0), Resume(1)),
    (job("PENDING", resumes=1), Resume(2)),
    (job("RUNNING", resumes=2), Fail("service restarted while the job was RUNNING; its run is gone and was "
                                     "already resumed 2 time(s) (limit 2)", kill=False)),
    (None, Keep()),                                          # deleted meanwhile
    (job("CANCELLED", resumes=0), Keep()),                   # cancelled jobs are never resumed
    (job("RUNNING", owner="mgr-other"), Keep()),             # another manager has it now
])
def test_settle_gone_run(current: JobRecord | None, decision: Any) -> None:
    assert settle_gone_run(current, ME, "service restarted", RULES) == decision


def test_a_resumed_run_starts_from_the_records_progress() -> None:
    record = job("RUNNING", attempts=2, started_at=T0 + 1, resumed_from_epoch=1)
    assert resume_state(record) == ResumeState(attempts=2, started_at=T0 + 1, progress=Progress(2, 5, 7, None),
                                               resumed_from_epoch=1)


def test_the_rules_are_pure() -> None:
    """The module reads no clock, database, store or cluster: its imports say so (read with ast)."""
    import ast
    from pathlib import Path

    import service.training.lifecycle as rules

    tree = ast.parse(Path(rules.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"__future__", "dataclasses", "typing", "service.training.run_snapshot", "service.training.spec",
                        "service.training.status", "service.training.store", "service.config.tunables"}, imported
