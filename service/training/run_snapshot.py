"""What a training run's actor tells its JobManager: one typed snapshot, the same object for a
poll's answer (service.training.run.TrainRun.snapshot) and for the outcome a run leaves in
its run dir when it ends (result.json, read back by a manager that finds the run gone).

Torch-free, Ray-free: the manager imports it without either. The job's record keeps these
values as JSON columns (service.training.store.JobRecord); `record_fields` gives them in
that shape, so the record's readers and the public API are unchanged.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from service.training.status import JobStatus


@dataclass(frozen=True)
class Progress:
    """Where the run is: the last finished epoch (0: none yet) of `epochs`, the optimizer steps
    so far, and the latest loss rank 0 reported (None: none yet)."""

    epoch: int = 0
    epochs: int = 0
    step: int = 0
    loss: float | None = None

    @classmethod
    def of(cls, doc: dict[str, Any] | None) -> Progress:
        """The progress a record's JSON column (or a result.json) holds; a key it lacks is unknown."""
        doc = doc or {}
        return cls(epoch=int(doc.get("epoch") or 0), epochs=int(doc.get("epochs") or 0),
                   step=int(doc.get("step") or 0), loss=doc.get("loss"))


@dataclass(frozen=True)
class EpochEntry:
    """One finished epoch of the job's history: its mean training loss, its held-out loss
    (None without held-out samples), and when the run actor recorded it (epoch seconds)."""

    epoch: int
    loss: float
    eval_loss: float | None = None
    at: float | None = None


@dataclass(frozen=True)
class WorkerEntry:
    """A DDP rank of the run's latest attempt: its process, node and interface."""

    rank: int
    pid: int
    node_id: str
    node_ip: str | None = None
    iface: str | None = None
    attempt: int = 1


@dataclass(frozen=True)
class LogLine:
    """One line of the run's log: its number in the run (`seq`, from 1), when, and the text."""

    seq: int
    at: float
    line: str


@dataclass(frozen=True)
class FinalCheckpoint:
    """The job's final checkpoint: an artifact key (`path`, relative to the storage root), the
    route that serves it, its format ("dense-<kind>", or "linear") and its size."""

    path: str
    url: str
    format: str
    bytes: int


@dataclass(frozen=True)
class RunSnapshot:
    """A run's state as its actor knows it. `history` and `logs` are suffixes: the epochs reported
    after the poll's `since_history_seq` (in epoch order; `history_seq` is the value to pass
    next) and the log lines after its `since_log_seq`. A result.json holds the whole of both."""

    status: JobStatus
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    progress: Progress = Progress()
    history: tuple[EpochEntry, ...] = ()
    history_seq: int = 0
    workers: tuple[WorkerEntry, ...] = ()
    attempts: int = 0
    resumed_from_epoch: int | None = None
    checkpoint: FinalCheckpoint | None = None
    logs: tuple[LogLine, ...] = ()

    def record_fields(self) -> dict[str, Any]:
        """The job record's columns a snapshot sets (the manager writes those that changed:
        service.training.lifecycle.snapshot_changes), as the record stores them (JSON values)."""
        return {
            "status": self.status, "error": self.error, "started_at": self.started_at,
            "finished_at": self.finished_at, "progress": dataclasses.asdict(self.progress),
            "workers": [dataclasses.asdict(w) for w in self.workers], "attempts": self.attempts,
            "checkpoint": dataclasses.asdict(self.checkpoint) if self.checkpoint is not None else None,
            "resumed_from_epoch": self.resumed_from_epoch,
        }

    def history_rows(self) -> list[dict[str, Any]]:
        """The new epochs as the record's history stores them: epoch, loss, eval_loss."""
        return [{"epoch": h.epoch, "loss": h.loss, "eval_loss": h.eval_loss} for h in self.history]

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RunSnapshot:
        """A result.json's snapshot; ValueError (naming what was wrong) for anything else."""
        try:
            doc = json.loads(data)
            checkpoint = doc.get("checkpoint")
            return cls(
                status=JobStatus(doc["status"]), error=doc.get("error"), started_at=doc.get("started_at"),
                finished_at=doc.get("finished_at"), progress=Progress.of(doc.get("progress")),
                history=tuple(EpochEntry(**h) for h in doc.get("history") or ()),
                history_seq=int(doc.get("history_seq") or 0),
                workers=tuple(WorkerEntry(**w) for w in doc.get("workers") or ()),
                attempts=int(doc.get("attempts") or 0), resumed_from_epoch=doc.get("resumed_from_epoch"),
                checkpoint=FinalCheckpoint(**checkpoint) if checkpoint is not None else None,
                logs=tuple(LogLine(**e) if isinstance(e, dict) else LogLine(*e) for e in doc.get("logs") or ()),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a run snapshot: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class ResumeState:
    """What a resumed run starts from (its job record's): attempts so far, when the job first
    ran (None: it never did), its progress, and the epoch its last attempt resumed from."""

    attempts: int
    started_at: float | None
    progress: Progress
    resumed_from_epoch: int | None
