"""SQLite store of job records, their log lines and uploaded datasets.

One file (`$GANGSERVE_STATE_DIR/jobs.sqlite`, WAL mode) shared by every JobManager on the
state dir. Every state change of a job is one committed UPDATE, so a restart keeps every
job with its status, history and checkpoint. Each active job has an `owner` (the JobManager
that polls its run); managers heartbeat, and a job whose owner stopped heartbeating is
adopted by another (see `adopt_orphans`).
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from service.training.spec import ACTIVE_STATUSES

MAX_LOG_LINES_PER_JOB = 2000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    id          TEXT UNIQUE NOT NULL,
    status      TEXT NOT NULL,
    spec        TEXT NOT NULL,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    started_at  REAL,
    finished_at REAL,
    reason      TEXT,
    error       TEXT,
    progress    TEXT NOT NULL,
    history     TEXT NOT NULL DEFAULT '[]',
    checkpoint  TEXT,
    workers     TEXT NOT NULL DEFAULT '[]',
    attempts    INTEGER NOT NULL DEFAULT 0,
    owner       TEXT
);
CREATE TABLE IF NOT EXISTS job_logs (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id  TEXT NOT NULL,
    run_seq INTEGER,            -- the run actor's line number; NULL for the manager's own lines
    ts      REAL NOT NULL,
    line    TEXT NOT NULL,
    UNIQUE (job_id, run_seq)
);
CREATE TABLE IF NOT EXISTS managers (
    id           TEXT PRIMARY KEY,
    heartbeat_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS datasets (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    id         TEXT UNIQUE NOT NULL,
    created_at REAL NOT NULL,
    info       TEXT NOT NULL,
    path       TEXT NOT NULL,
    bytes      INTEGER NOT NULL
);
"""

_JSON_FIELDS = ("spec", "progress", "history", "checkpoint", "workers")
_UPDATABLE = {
    "status", "reason", "error", "progress", "history", "checkpoint", "workers", "attempts",
    "started_at", "finished_at", "owner",
}


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds")


@dataclass
class JobRecord:
    id: str
    status: str
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
    seq: int = 0

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    def to_public(self) -> dict[str, Any]:
        """The contract's job shape (plus reason, timings, attempts and workers)."""
        return {
            "id": self.id,
            "status": self.status,
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
        }


class JobStore:
    """Thread-safe access to the SQLite file; every method is one short transaction."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # isolation_level=None: autocommit; multi-statement changes use explicit BEGIN IMMEDIATE.
        self._db = sqlite3.connect(str(self.path), timeout=10.0, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- jobs ---------------------------------------------------------------------------

    def create_job(self, record: JobRecord) -> JobRecord:
        row = {k: getattr(record, k) for k in (
            "id", "status", "spec", "created_at", "updated_at", "started_at", "finished_at", "reason",
            "error", "progress", "history", "checkpoint", "workers", "attempts", "owner")}
        for k in _JSON_FIELDS:
            row[k] = json.dumps(row[k])
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self._lock:
            cur = self._db.execute(f"INSERT INTO jobs ({cols}) VALUES ({marks})", tuple(row.values()))
            record.seq = int(cur.lastrowid or 0)
        return record

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _record(row) if row else None

    def list_jobs(self, limit: int, cursor: int | None = None) -> tuple[list[JobRecord], int | None]:
        """Newest first; `cursor` is the `next` of the previous page (None: first page)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                (cursor if cursor is not None else 2**62, limit + 1),
            ).fetchall()
        records = [_record(r) for r in rows[:limit]]
        nxt = records[-1].seq if len(rows) > limit else None
        return records, nxt

    def update_job(self, job_id: str, *, only_active: bool = True, **fields: Any) -> bool:
        """Apply `fields` (and updated_at = now). With only_active, a job that already reached
        a terminal status is left alone (so a late progress update cannot undo a cancel).
        Returns whether a row changed."""
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise ValueError(f"not updatable job fields: {sorted(unknown)}")
        values = {k: (json.dumps(v) if k in _JSON_FIELDS else v) for k, v in fields.items()}
        values["updated_at"] = time.time()
        sets = ", ".join(f"{k} = ?" for k in values)
        where = "id = ?"
        params: list[Any] = [*values.values(), job_id]
        if only_active:
            where += f" AND status IN ({', '.join('?' for _ in ACTIVE_STATUSES)})"
            params.extend(ACTIVE_STATUSES)
        with self._lock:
            cur = self._db.execute(f"UPDATE jobs SET {sets} WHERE {where}", params)
        return cur.rowcount > 0

    # ---- logs ---------------------------------------------------------------------------

    def append_logs(self, job_id: str, entries: Iterable[tuple[int | None, float, str]]) -> None:
        """Insert (run_seq, ts, line) entries; run_seq None marks the manager's own lines.

        A run line already stored (same run_seq) is ignored, so re-polling is harmless.
        Only the newest MAX_LOG_LINES_PER_JOB lines of a job are kept.
        """
        entries = list(entries)
        if not entries:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT OR IGNORE INTO job_logs (job_id, run_seq, ts, line) VALUES (?, ?, ?, ?)",
                    [(job_id, s, ts, line) for s, ts, line in entries],
                )
                self._db.execute(
                    "DELETE FROM job_logs WHERE job_id = ? AND id NOT IN "
                    "(SELECT id FROM job_logs WHERE job_id = ? ORDER BY id DESC LIMIT ?)",
                    (job_id, job_id, MAX_LOG_LINES_PER_JOB),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def last_run_log_seq(self, job_id: str) -> int:
        """The run actor's newest stored line number (0: none), to resume polling after a restart."""
        with self._lock:
            row = self._db.execute("SELECT MAX(run_seq) FROM job_logs WHERE job_id = ?", (job_id,)).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def tail_logs(self, job_id: str, n: int) -> list[tuple[float, str]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT ts, line FROM job_logs WHERE job_id = ? ORDER BY id DESC LIMIT ?", (job_id, n)
            ).fetchall()
        return [(r["ts"], r["line"]) for r in reversed(rows)]

    # ---- ownership ----------------------------------------------------------------------

    def heartbeat(self, owner: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO managers (id, heartbeat_at) VALUES (?, ?) "
                "ON CONFLICT(id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
                (owner, time.time()),
            )

    def adopt_orphans(self, owner: str, stale_after_s: float) -> list[JobRecord]:
        """Take over active jobs whose owner has not heartbeaten for stale_after_s (or has none).

        Atomic (BEGIN IMMEDIATE), so two managers never adopt the same job.
        """
        cutoff = time.time() - stale_after_s
        marks = ", ".join("?" for _ in ACTIVE_STATUSES)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute(
                    f"SELECT * FROM jobs WHERE status IN ({marks}) AND (owner IS NULL OR (owner != ? AND owner NOT IN "
                    "(SELECT id FROM managers WHERE heartbeat_at >= ?)))",
                    (*ACTIVE_STATUSES, owner, cutoff),
                ).fetchall()
                for row in rows:
                    self._db.execute("UPDATE jobs SET owner = ? WHERE id = ?", (owner, row["id"]))
                self._db.execute("DELETE FROM managers WHERE heartbeat_at < ?", (cutoff - 3600,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        adopted = [_record(r) for r in rows]
        for rec in adopted:
            rec.owner = owner
        return adopted

    # ---- datasets -----------------------------------------------------------------------

    def add_dataset(self, dataset_id: str, info: dict[str, Any], path: str, nbytes: int) -> dict[str, Any]:
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT INTO datasets (id, created_at, info, path, bytes) VALUES (?, ?, ?, ?, ?)",
                (dataset_id, now, json.dumps(info), path, nbytes),
            )
        return _dataset_public(dataset_id, now, info, nbytes)

    def get_dataset(self, dataset_id: str) -> tuple[dict[str, Any], str] | None:
        """(public description, absolute path) or None."""
        with self._lock:
            row = self._db.execute("SELECT * FROM datasets WHERE id = ?", (dataset_id,)).fetchone()
        if row is None:
            return None
        return _dataset_public(row["id"], row["created_at"], json.loads(row["info"]), row["bytes"]), row["path"]

    def list_datasets(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM datasets ORDER BY seq DESC").fetchall()
        return [_dataset_public(r["id"], r["created_at"], json.loads(r["info"]), r["bytes"]) for r in rows]


def _dataset_public(dataset_id: str, created_at: float, info: dict[str, Any], nbytes: int) -> dict[str, Any]:
    return {"id": dataset_id, "created_at": iso(created_at), "bytes": nbytes, **info}


def _record(row: sqlite3.Row) -> JobRecord:
    data = dict(row)
    for k in _JSON_FIELDS:
        data[k] = json.loads(data[k]) if data[k] is not None else None
    data["history"] = data["history"] or []
    data["workers"] = data["workers"] or []
    return JobRecord(**data)
