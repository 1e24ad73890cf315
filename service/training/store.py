"""The job store: job records, their loss history, log lines and uploaded datasets.

Tables of the state database (service.state.db: `GANGSERVE_DATABASE_URL`, default the
SQLite file `$GANGSERVE_STATE_DIR/jobs.sqlite`; PostgreSQL for clusters). Every state change
of a job is one committed statement or transaction, so a restart keeps every job with its
status, history and checkpoint. The loss history is a table of its own (one row per epoch),
written incrementally: a poll stores the epochs reported since the last one, never the
whole history again.

Ownership: each active job has an `owner` (the JobManager that polls its run); managers
heartbeat, and a job whose owner stopped heartbeating is adopted by another (see
`adopt_orphans`). This is what lets a replacement JobManager replica (Serve restarted it,
or its node died) take over the jobs of the one it replaces; the app runs one JobManager.

Admission (`create_job`, `add_dataset`) counts usage and inserts in one transaction of the
store's lock, so concurrent submits, from any number of processes, cannot overshoot a
quota. The JSON columns are read and summed in Python (no json_extract): the SQL stays the
same on SQLite and PostgreSQL.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

from service.state.db import Database, DatabaseStore, Row, Session, sqlite_url
from service.training.limits import ActiveUsage
from service.training.status import ACTIVE, JobStatus, parse, sources
from service.config.tunables import StateTunables, TrainingTunables

log = logging.getLogger("gangserve.training")

STORE = "jobs"
LOCK = "jobs"  # the transaction lock of every multi-statement write of this store

# The store's schema: the Alembic branch "jobs" (service/state/migrations/versions/jobs_*.py).

_JSON_FIELDS = ("spec", "progress", "history", "checkpoint", "workers", "init_from")
# `history` is not updatable: it is written incrementally with `put_history`.
_UPDATABLE = {
    "status", "reason", "error", "progress", "checkpoint", "workers", "attempts",
    "started_at", "finished_at", "owner", "resumes", "resumed_from_epoch",
}
_ACTIVE_MARKS = ", ".join("?" for _ in ACTIVE)
_ACTIVE_VALUES = tuple(s.value for s in ACTIVE)  # bound as plain str on every driver


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds")


@dataclass
class JobRecord:
    id: str
    status: JobStatus  # a str: compares equal to "PENDING" etc.
    spec: dict[str, Any]
    created_at: float
    updated_at: float
    progress: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    started_at: float | None = None
    finished_at: float | None = None
    reason: str | None = None
    error: str | None = None
    checkpoint: dict[str, Any] | None = None
    workers: list[dict[str, Any]] = field(default_factory=list)
    attempts: int = 0
    owner: str | None = None
    init_from: dict[str, Any] | None = None
    resumes: int = 0
    resumed_from_epoch: int | None = None
    seq: int = 0

    def __post_init__(self) -> None:
        self.status = parse(self.status)  # a plain str (a row, a test) becomes the enum

    @property
    def active(self) -> bool:
        return self.status.active

    @property
    def final_eval_loss(self) -> float | None:
        """The held-out loss of the final checkpoint (the last epoch's), once SUCCEEDED."""
        if self.status != JobStatus.SUCCEEDED or not self.history:
            return None
        last = self.history[-1].get("eval_loss")
        return None if last is None else float(last)

    def to_public(self) -> dict[str, Any]:
        """The contract's job shape (plus reason, timings, attempts and workers)."""
        return {
            "id": self.id,
            "status": self.status.value,
            "spec": self.spec,
            "created_at": iso(self.created_at),
            "updated_at": iso(self.updated_at),
            "started_at": iso(self.started_at),
            "finished_at": iso(self.finished_at),
            "progress": self.progress,
            "history": self.history,
            "reason": self.reason,
            "error": self.error,
            "checkpoint": self.checkpoint,
            "attempts": self.attempts,
            "workers": self.workers,
            "init_from": self.init_from,
            "final_eval_loss": self.final_eval_loss,
            "resumes": self.resumes,
            "resumed_from_epoch": self.resumed_from_epoch,
        }


class JobStore(DatabaseStore):
    """Thread-safe access to the job tables; every method is one short statement or
    transaction. Raises service.state.db.StateUnavailable (503) when the database cannot be
    reached, at construction or later; nothing is half-written then."""

    def __init__(self, database: str | Path | Database, training: TrainingTunables | None = None,
                 state: StateTunables | None = None) -> None:
        """`database`: a SQLite file path, a database URL (sqlite:/// or postgresql://), or an
        open Database (then not closed by `close`). `training`: its log retention
        (max_log_lines_per_job); `state`: the waits of a Database opened here (defaults: the
        tunables' defaults)."""
        if not isinstance(database, Database):
            database = str(database) if "://" in str(database) else sqlite_url(database)
        self._max_log_lines = (training or TrainingTunables()).max_log_lines_per_job
        self._open(database, STORE, state)
        self.path = self._db.path  # the SQLite file (None on PostgreSQL)
        self.journal_mode = self._db.journal_mode
        log.info("job store on %s%s", self._db.url,
                 f" (journal_mode {self.journal_mode})" if self.journal_mode else "")

    # ---- jobs ---------------------------------------------------------------------------

    def create_job(
        self,
        record: JobRecord,
        admit: Callable[[ActiveUsage], None] | None = None,
        dataset_id: str | None = None,
    ) -> JobRecord:
        """Insert a job. In the same write transaction (so concurrent submits, from any
        number of managers, cannot both take the last slot): `admit(usage)` may refuse it
        by raising, and `dataset_id` must still exist (else LookupError)."""
        row = {k: getattr(record, k) for k in (
            "id", "status", "spec", "created_at", "updated_at", "started_at", "finished_at", "reason",
            "error", "progress", "checkpoint", "workers", "attempts", "owner", "init_from", "resumes",
            "resumed_from_epoch")}
        for k in _JSON_FIELDS:
            if k in row:
                row[k] = json.dumps(row[k])
        row["status"] = record.status.value
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self._db.transaction(LOCK) as s:
            if admit is not None:
                admit(_active_usage(s))
            if dataset_id is not None and s.one("SELECT 1 AS found FROM datasets WHERE id = ?", (dataset_id,)) is None:
                raise LookupError(dataset_id)
            seq = s.value(f"INSERT INTO jobs ({cols}) VALUES ({marks}) RETURNING seq", tuple(row.values()))
            _insert_history(s, record.id, record.history)
        record.seq = int(seq or 0)
        return record

    def active_usage(self) -> ActiveUsage:
        with self._db.session() as s:
            return _active_usage(s)

    def status_counts(self) -> dict[str, int]:
        """Jobs per status (the /metrics gauge gangserve_training_jobs)."""
        with self._db.session() as s:
            rows = s.all("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")
        return {str(r["status"]): int(r["n"]) for r in rows}

    def get_job(self, job_id: str, with_history: bool = True) -> JobRecord | None:
        """One job; `with_history=False` skips reading its loss history (the poller's reads)."""
        with self._db.session() as s:
            row = s.one("SELECT * FROM jobs WHERE id = ?", (job_id,))
            if row is None:
                return None
            record = _record(row)
            if with_history:
                _attach_history(s, [record])
        return record

    def delete_job(self, job_id: str) -> bool:
        """Remove a job's record, loss history and log lines; whether it existed."""
        with self._db.transaction(LOCK) as s:
            deleted = s.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            s.execute("DELETE FROM job_history WHERE job_id = ?", (job_id,))
            s.execute("DELETE FROM job_logs WHERE job_id = ?", (job_id,))
        return deleted > 0

    # ---- loss history -------------------------------------------------------------------

    def put_history(self, job_id: str, entries: Iterable[dict[str, Any]]) -> None:
        """Store newly reported epochs, in report order. A report of epoch e replaces e and
        drops any later epochs (a resumed attempt re-reports from its checkpoint on), so the
        table always equals the run's own history. Ignored for a job that no longer exists."""
        entries = list(entries)
        if not entries:
            return
        with self._db.transaction(LOCK) as s:
            if s.one("SELECT 1 AS found FROM jobs WHERE id = ?", (job_id,)) is not None:
                _insert_history(s, job_id, entries)

    def list_jobs(self, limit: int, cursor: int | None = None) -> tuple[list[JobRecord], int | None]:
        """Newest first; `cursor` is the `next` of the previous page (None: first page)."""
        with self._db.session() as s:
            rows = s.all(
                "SELECT * FROM jobs WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                (cursor if cursor is not None else 2**62, limit + 1),
            )
            records = [_record(r) for r in rows[:limit]]
            _attach_history(s, records)
        nxt = records[-1].seq if len(rows) > limit else None
        return records, nxt

    def update_job(self, job_id: str, *, only_active: bool = True, **fields: Any) -> bool:
        """Apply `fields` (and updated_at = now) in one atomic UPDATE, guarded by the job's
        current status (service.training.status, the one transition table):
        - with a `status`, only from the statuses that may move to it (`sources`): a terminal
          job is never rewritten, RUNNING never goes back to PENDING;
        - without one, with only_active (the default), only while the job is active (so a
          late progress update cannot undo a cancel).
        Returns whether a row changed: False for an unknown job or a refused move (the
        caller reads the job again to say which). ValueError for an unknown field or status."""
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise ValueError(f"not updatable job fields: {sorted(unknown)}")
        guard: tuple[JobStatus, ...] | None = ACTIVE if only_active else None
        if "status" in fields:
            fields["status"] = parse(fields["status"]).value  # the plain str is what is stored
            guard = sources(fields["status"])
        values = {k: (json.dumps(v) if k in _JSON_FIELDS else v) for k, v in fields.items()}
        values["updated_at"] = time.time()
        sets = ", ".join(f"{k} = ?" for k in values)
        where = "id = ?"
        params: list[Any] = [*values.values(), job_id]
        if guard is not None:
            # The IN list is derived from the table; the check and the write are one statement,
            # so two writers racing (poller vs cancel) cannot both win.
            where += f" AND status IN ({', '.join('?' for _ in guard)})"
            params.extend(g.value for g in guard)
        with self._db.session() as s:  # one statement: atomic on its own
            return s.execute(f"UPDATE jobs SET {sets} WHERE {where}", params) > 0

    # ---- logs ---------------------------------------------------------------------------

    def append_logs(self, job_id: str, entries: Iterable[tuple[int | None, float, str]]) -> None:
        """Insert (run_seq, ts, line) entries; run_seq None marks the manager's own lines.

        A run line already stored (same run_seq) is ignored, so re-polling is harmless.
        Only the newest training.max_log_lines_per_job lines of a job are kept.
        """
        entries = list(entries)
        if not entries:
            return
        with self._db.transaction(LOCK) as s:
            if s.one("SELECT 1 AS found FROM jobs WHERE id = ?", (job_id,)) is None:
                return  # deleted (or never created): no orphan lines
            s.executemany(
                "INSERT INTO job_logs (job_id, run_seq, ts, line) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (job_id, run_seq) DO NOTHING",
                [(job_id, seq, ts, line) for seq, ts, line in entries],
            )
            s.execute(
                "DELETE FROM job_logs WHERE job_id = ? AND id NOT IN "
                "(SELECT id FROM job_logs WHERE job_id = ? ORDER BY id DESC LIMIT ?)",
                (job_id, job_id, self._max_log_lines),
            )

    def last_run_log_seq(self, job_id: str) -> int:
        """The run actor's newest stored line number (0: none), to resume polling after a restart."""
        with self._db.session() as s:
            top = s.value("SELECT MAX(run_seq) AS top FROM job_logs WHERE job_id = ?", (job_id,))
        return int(top) if top is not None else 0

    def tail_logs(self, job_id: str, n: int) -> list[tuple[float, str]]:
        with self._db.session() as s:
            rows = s.all("SELECT ts, line FROM job_logs WHERE job_id = ? ORDER BY id DESC LIMIT ?", (job_id, n))
        return [(r["ts"], r["line"]) for r in reversed(rows)]

    # ---- ownership ----------------------------------------------------------------------

    def heartbeat(self, owner: str) -> None:
        with self._db.session() as s:
            s.execute(
                "INSERT INTO managers (id, heartbeat_at) VALUES (?, ?) "
                "ON CONFLICT (id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
                (owner, time.time()),
            )

    def adopt_orphans(self, owner: str, stale_after_s: float) -> list[JobRecord]:
        """Take over active jobs whose owner has not heartbeaten for stale_after_s (or has none).

        One transaction of the store's lock, so two managers never adopt the same job.
        """
        cutoff = time.time() - stale_after_s
        with self._db.transaction(LOCK) as s:
            rows = s.all(
                f"SELECT * FROM jobs WHERE status IN ({_ACTIVE_MARKS}) AND (owner IS NULL OR (owner != ? AND owner "
                "NOT IN (SELECT id FROM managers WHERE heartbeat_at >= ?)))",
                (*_ACTIVE_VALUES, owner, cutoff),
            )
            for row in rows:
                s.execute("UPDATE jobs SET owner = ? WHERE id = ?", (owner, row["id"]))
            s.execute("DELETE FROM managers WHERE heartbeat_at < ?", (cutoff - 3600,))
        adopted = [_record(r) for r in rows]
        for rec in adopted:
            rec.owner = owner
        return adopted

    # ---- datasets -----------------------------------------------------------------------

    def add_dataset(
        self, dataset_id: str, info: dict[str, Any], path: str, nbytes: int,
        admit: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """Insert a dataset; `admit(count, total_bytes)` of the stored ones may refuse it by
        raising, in the same write transaction."""
        now = time.time()
        with self._db.transaction(LOCK) as s:
            if admit is not None:
                admit(*_dataset_usage(s))
            s.execute(
                "INSERT INTO datasets (id, created_at, info, path, bytes) VALUES (?, ?, ?, ?, ?)",
                (dataset_id, now, json.dumps(info), path, nbytes),
            )
        return _dataset_public(dataset_id, now, info, nbytes)

    def dataset_usage(self) -> tuple[int, int]:
        """(count, total bytes) of the stored datasets."""
        with self._db.session() as s:
            return _dataset_usage(s)

    def delete_dataset(self, dataset_id: str) -> tuple[dict[str, Any], str]:
        """Remove a dataset's record: (public description, path of its file to remove).
        KeyError if there is none; DatasetInUse if an active job trains on it."""
        with self._db.transaction(LOCK) as s:
            row = s.one("SELECT * FROM datasets WHERE id = ?", (dataset_id,))
            if row is None:
                raise KeyError(dataset_id)
            active = s.all(f"SELECT id, spec FROM jobs WHERE status IN ({_ACTIVE_MARKS}) ORDER BY seq",
                           _ACTIVE_VALUES)
            users = [r["id"] for r in active if _spec_dataset_id(r["spec"]) == dataset_id]
            if users:
                raise DatasetInUse(users)
            s.execute("DELETE FROM datasets WHERE id = ?", (dataset_id,))
        return _dataset_public(row["id"], row["created_at"], json.loads(row["info"]), row["bytes"]), row["path"]

    def get_dataset(self, dataset_id: str) -> tuple[dict[str, Any], str] | None:
        """(public description, absolute path) or None."""
        with self._db.session() as s:
            row = s.one("SELECT * FROM datasets WHERE id = ?", (dataset_id,))
        if row is None:
            return None
        return _dataset_public(row["id"], row["created_at"], json.loads(row["info"]), row["bytes"]), row["path"]

    def list_datasets(self) -> list[dict[str, Any]]:
        with self._db.session() as s:
            rows = s.all("SELECT * FROM datasets ORDER BY seq DESC")
        return [_dataset_public(r["id"], r["created_at"], json.loads(r["info"]), r["bytes"]) for r in rows]


# ---- statements shared by several methods (run inside the caller's session) ------------------

def _active_usage(s: Session) -> ActiveUsage:
    """Jobs, workers and GPUs held by the active jobs. Summed here from each spec (active jobs
    are few: the quota bounds them), so no dialect's JSON functions are needed."""
    jobs = workers = gpus = 0
    for row in s.all(f"SELECT spec FROM jobs WHERE status IN ({_ACTIVE_MARKS})", _ACTIVE_VALUES):
        spec = json.loads(row["spec"])
        size = int(spec.get("world_size") or 0)
        jobs += 1
        workers += size
        gpus += size if spec.get("use_gpu") else 0
    return ActiveUsage(jobs=jobs, workers=workers, gpus=gpus)


def _dataset_usage(s: Session) -> tuple[int, int]:
    row = s.one("SELECT COUNT(*) AS n, COALESCE(SUM(bytes), 0) AS total FROM datasets")
    assert row is not None
    return int(row["n"]), int(row["total"])


def _spec_dataset_id(spec_json: str) -> str | None:
    dataset = json.loads(spec_json).get("dataset")
    return dataset.get("id") if isinstance(dataset, dict) else None


def _insert_history(s: Session, job_id: str, entries: Iterable[dict[str, Any]]) -> None:
    for e in entries:
        s.execute("DELETE FROM job_history WHERE job_id = ? AND epoch >= ?", (job_id, int(e["epoch"])))
        s.execute(
            "INSERT INTO job_history (job_id, epoch, loss, eval_loss, at) VALUES (?, ?, ?, ?, ?)",
            (job_id, int(e["epoch"]), e.get("loss"), e.get("eval_loss"), e.get("at")),
        )


def _attach_history(s: Session, records: list[JobRecord]) -> None:
    """Fill each record's history from job_history (records written before the table
    existed keep the history of their JSON column)."""
    if not records:
        return
    marks = ", ".join("?" for _ in records)
    rows = s.all(
        f"SELECT job_id, epoch, loss, eval_loss, at FROM job_history WHERE job_id IN ({marks}) ORDER BY job_id, epoch",
        [r.id for r in records],
    )
    by_job: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        entry: dict[str, Any] = {"epoch": r["epoch"], "loss": r["loss"], "eval_loss": r["eval_loss"]}
        if r["at"] is not None:
            entry["at"] = r["at"]
        by_job.setdefault(r["job_id"], []).append(entry)
    for record in records:
        if record.id in by_job:
            record.history = by_job[record.id]


class DatasetInUse(Exception):
    """Active jobs train on the dataset; `job_ids` names them."""

    def __init__(self, job_ids: list[str]) -> None:
        super().__init__(", ".join(job_ids))
        self.job_ids = job_ids


def _dataset_public(dataset_id: str, created_at: float, info: dict[str, Any], nbytes: int) -> dict[str, Any]:
    return {"id": dataset_id, "created_at": iso(created_at), "bytes": nbytes, **info}


def _record(row: Row) -> JobRecord:
    data = dict(row)
    for k in _JSON_FIELDS:
        data[k] = json.loads(data[k]) if data[k] is not None else None
    data["history"] = data["history"] or []
    data["workers"] = data["workers"] or []
    return JobRecord(**data)
