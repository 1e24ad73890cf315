"""SQLite store of job records, their loss history, log lines and uploaded datasets.

One file (`$GANGSERVE_STATE_DIR/jobs.sqlite`). Every state change of a job is one committed
UPDATE, so a restart keeps every job with its status, history and checkpoint. The loss
history is a table of its own (one row per epoch), written incrementally: a poll stores the
epochs reported since the last one, never the whole history again. Each active job has an
`owner` (the JobManager that polls its run); managers heartbeat, and a job whose owner
stopped heartbeating is adopted by another (see `adopt_orphans`).

Journal mode (`journal_mode_for`): WAL only when the file is on a local file system. WAL
keeps its index in shared memory next to the database, which processes on different hosts
cannot share, so on a network or FUSE file system (NFS, CIFS, CephFS, a FUSE mount ...,
read from /proc/mounts) the store uses the rollback journal (`DELETE`), and it must have a
single writer: the one JobManager replica. `GANGSERVE_SQLITE_JOURNAL=wal|delete` overrides
the detection.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

from service.training.limits import ActiveUsage
from service.training.spec import ACTIVE_STATUSES

log = logging.getLogger("gangserve.training")

MAX_LOG_LINES_PER_JOB = 2000
JOURNAL_ENV = "GANGSERVE_SQLITE_JOURNAL"
# File systems on which SQLite's WAL is unsafe (its -shm index is memory shared between
# processes on ONE host) and file locking is at best advisory: network, cluster and FUSE
# file systems. Any "fuse.*" type (sshfs, s3fs, gcsfuse, juicefs ...) counts too.
SHARED_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
    "afs", "ocfs2", "gfs2", "9p", "virtiofs", "orangefs", "pvfs2", "panfs", "wekafs", "davfs", "fuse", "fuseblk",
})

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
CREATE TABLE IF NOT EXISTS job_history (
    job_id TEXT NOT NULL,
    epoch  INTEGER NOT NULL,
    loss   REAL,
    at     REAL,
    PRIMARY KEY (job_id, epoch)
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
# `history` is not updatable: it is written incrementally with `put_history`.
_UPDATABLE = {
    "status", "reason", "error", "progress", "checkpoint", "workers", "attempts",
    "started_at", "finished_at", "owner",
}
_ACTIVE_MARKS = ", ".join("?" for _ in ACTIVE_STATUSES)


def _unescape_mount(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: str | Path, mounts: str | None = None) -> str | None:
    """The type of the file system holding `path` (the mount with the longest matching mount
    point), from the text of /proc/mounts (read when `mounts` is None); None if unknown."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point, fstype = _unescape_mount(parts[1]), parts[2]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, fstype
    return best_type


def is_shared_fs(fstype: str | None) -> bool:
    return fstype is not None and (fstype in SHARED_FS_TYPES or fstype.startswith("fuse."))


def journal_mode_for(db_path: str | Path, mounts: str | None = None) -> tuple[str, str]:
    """("wal" | "delete", why): WAL on a local disk, the rollback journal on a shared one."""
    forced = os.environ.get(JOURNAL_ENV, "").strip().lower()
    if forced in ("wal", "delete"):
        return forced, f"{JOURNAL_ENV}={forced}"
    fstype = filesystem_type(Path(db_path).parent, mounts)
    if is_shared_fs(fstype):
        return "delete", f"{fstype} is a network/shared file system: rollback journal, single writer"
    return "wal", f"local file system ({fstype or 'type unknown'})"


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
        self.journal_mode, why = journal_mode_for(self.path)
        with self._lock:
            got = self._db.execute(f"PRAGMA journal_mode={self.journal_mode.upper()}").fetchone()[0]
            if str(got).lower() != self.journal_mode:
                log.warning("job store %s: asked for journal_mode %s (%s), SQLite kept %s",
                            self.path, self.journal_mode, why, got)
            self.journal_mode = str(got).lower()
            # NORMAL is durable in WAL mode; the rollback journal needs FULL not to lose commits.
            self._db.execute("PRAGMA synchronous=" + ("NORMAL" if self.journal_mode == "wal" else "FULL"))
            self._db.executescript(_SCHEMA)
        log.info("job store %s: journal_mode %s (%s)", self.path, self.journal_mode, why)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- jobs ---------------------------------------------------------------------------

    def create_job(
        self,
        record: JobRecord,
        admit: Callable[[ActiveUsage], None] | None = None,
        dataset_id: str | None = None,
    ) -> JobRecord:
        """Insert a job. In the same write transaction (so concurrent submits, even from
        several managers, cannot both take the last slot): `admit(usage)` may refuse it by
        raising, and `dataset_id` must still exist (else LookupError)."""
        row = {k: getattr(record, k) for k in (
            "id", "status", "spec", "created_at", "updated_at", "started_at", "finished_at", "reason",
            "error", "progress", "checkpoint", "workers", "attempts", "owner")}
        for k in _JSON_FIELDS:
            if k in row:
                row[k] = json.dumps(row[k])
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if admit is not None:
                    admit(self._active_usage())
                if dataset_id is not None and self._db.execute(
                        "SELECT 1 FROM datasets WHERE id = ?", (dataset_id,)).fetchone() is None:
                    raise LookupError(dataset_id)
                cur = self._db.execute(f"INSERT INTO jobs ({cols}) VALUES ({marks})", tuple(row.values()))
                self._insert_history(record.id, record.history)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            record.seq = int(cur.lastrowid or 0)
        return record

    def active_usage(self) -> ActiveUsage:
        with self._lock:
            return self._active_usage()

    def status_counts(self) -> dict[str, int]:
        """Jobs per status (the /metrics gauge gangserve_training_jobs)."""
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    def _active_usage(self) -> ActiveUsage:
        row = self._db.execute(
            "SELECT COUNT(*), "
            "COALESCE(SUM(json_extract(spec, '$.world_size')), 0), "
            "COALESCE(SUM(CASE WHEN json_extract(spec, '$.use_gpu') THEN json_extract(spec, '$.world_size') "
            "ELSE 0 END), 0) "
            f"FROM jobs WHERE status IN ({_ACTIVE_MARKS})",
            ACTIVE_STATUSES,
        ).fetchone()
        return ActiveUsage(jobs=int(row[0]), workers=int(row[1]), gpus=int(row[2]))

    def get_job(self, job_id: str, with_history: bool = True) -> JobRecord | None:
        """One job; `with_history=False` skips reading its loss history (the poller's reads)."""
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            record = _record(row)
            if with_history:
                self._attach_history([record])
        return record

    def delete_job(self, job_id: str) -> bool:
        """Remove a job's record, loss history and log lines; whether it existed."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
                self._db.execute("DELETE FROM job_history WHERE job_id = ?", (job_id,))
                self._db.execute("DELETE FROM job_logs WHERE job_id = ?", (job_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return cur.rowcount > 0

    # ---- loss history -------------------------------------------------------------------

    def put_history(self, job_id: str, entries: Iterable[dict[str, Any]]) -> None:
        """Store newly reported epochs, in report order. A report of epoch e replaces e and
        drops any later epochs (a resumed attempt re-reports from its checkpoint on), so the
        table always equals the run's own history. Ignored for a job that no longer exists."""
        entries = list(entries)
        if not entries:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if self._db.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone() is not None:
                    self._insert_history(job_id, entries)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _insert_history(self, job_id: str, entries: Iterable[dict[str, Any]]) -> None:
        for e in entries:
            self._db.execute("DELETE FROM job_history WHERE job_id = ? AND epoch >= ?", (job_id, int(e["epoch"])))
            self._db.execute(
                "INSERT INTO job_history (job_id, epoch, loss, at) VALUES (?, ?, ?, ?)",
                (job_id, int(e["epoch"]), e.get("loss"), e.get("at")),
            )

    def _attach_history(self, records: list[JobRecord]) -> None:
        """Fill each record's history from job_history (records written before the table
        existed keep the history of their JSON column)."""
        if not records:
            return
        marks = ", ".join("?" for _ in records)
        rows = self._db.execute(
            f"SELECT job_id, epoch, loss, at FROM job_history WHERE job_id IN ({marks}) ORDER BY job_id, epoch",
            [r.id for r in records],
        ).fetchall()
        by_job: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            entry: dict[str, Any] = {"epoch": r["epoch"], "loss": r["loss"]}
            if r["at"] is not None:
                entry["at"] = r["at"]
            by_job.setdefault(r["job_id"], []).append(entry)
        for record in records:
            if record.id in by_job:
                record.history = by_job[record.id]

    def list_jobs(self, limit: int, cursor: int | None = None) -> tuple[list[JobRecord], int | None]:
        """Newest first; `cursor` is the `next` of the previous page (None: first page)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                (cursor if cursor is not None else 2**62, limit + 1),
            ).fetchall()
            records = [_record(r) for r in rows[:limit]]
            self._attach_history(records)
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
                if self._db.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone() is None:
                    self._db.execute("COMMIT")  # deleted (or never created): no orphan lines
                    return
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

    def add_dataset(
        self, dataset_id: str, info: dict[str, Any], path: str, nbytes: int,
        admit: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """Insert a dataset; `admit(count, total_bytes)` of the stored ones may refuse it by
        raising, in the same write transaction."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if admit is not None:
                    count, total = self._dataset_usage()
                    admit(count, total)
                self._db.execute(
                    "INSERT INTO datasets (id, created_at, info, path, bytes) VALUES (?, ?, ?, ?, ?)",
                    (dataset_id, now, json.dumps(info), path, nbytes),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return _dataset_public(dataset_id, now, info, nbytes)

    def dataset_usage(self) -> tuple[int, int]:
        """(count, total bytes) of the stored datasets."""
        with self._lock:
            return self._dataset_usage()

    def _dataset_usage(self) -> tuple[int, int]:
        row = self._db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM datasets").fetchone()
        return int(row[0]), int(row[1])

    def delete_dataset(self, dataset_id: str) -> tuple[dict[str, Any], str]:
        """Remove a dataset's record: (public description, path of its file to remove).
        KeyError if there is none; DatasetInUse if an active job trains on it."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT * FROM datasets WHERE id = ?", (dataset_id,)).fetchone()
                if row is None:
                    raise KeyError(dataset_id)
                users = [r[0] for r in self._db.execute(
                    f"SELECT id FROM jobs WHERE status IN ({_ACTIVE_MARKS}) "
                    "AND json_extract(spec, '$.dataset.id') = ? ORDER BY seq",
                    (*ACTIVE_STATUSES, dataset_id),
                ).fetchall()]
                if users:
                    raise DatasetInUse(users)
                self._db.execute("DELETE FROM datasets WHERE id = ?", (dataset_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return _dataset_public(row["id"], row["created_at"], json.loads(row["info"]), row["bytes"]), row["path"]

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


class DatasetInUse(Exception):
    """Active jobs train on the dataset; `job_ids` names them."""

    def __init__(self, job_ids: list[str]) -> None:
        super().__init__(", ".join(job_ids))
        self.job_ids = job_ids


def _dataset_public(dataset_id: str, created_at: float, info: dict[str, Any], nbytes: int) -> dict[str, Any]:
    return {"id": dataset_id, "created_at": iso(created_at), "bytes": nbytes, **info}


def _record(row: sqlite3.Row) -> JobRecord:
    data = dict(row)
    for k in _JSON_FIELDS:
        data[k] = json.loads(data[k]) if data[k] is not None else None
    data["history"] = data["history"] or []
    data["workers"] = data["workers"] or []
    return JobRecord(**data)
