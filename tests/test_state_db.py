"""The state database (service.state.db) on its own: URL selection and redaction, clear
start-up errors, versioned migrations (a file of the pre-versioning schema upgrades with its
rows), and a PostgreSQL server lost mid-run (the typed error, then everything works again
and nothing is lost). Real SQLite files and a real PostgreSQL server (tests/postgres.py)."""
from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from harness.local import free_port

pytestmark = pytest.mark.unit


def _job(i: int, **kw: Any) -> Any:
    from service.training.store import JobRecord

    spec = kw.pop("spec", {"world_size": 1, "use_gpu": False})
    return JobRecord(id=f"job-{i}", status=kw.pop("status", "PENDING"), spec=spec, created_at=i, updated_at=i,
                     progress={"epoch": 0, "epochs": 1, "step": 0}, **kw)


# ---- the URL ---------------------------------------------------------------------------------

def errors_of_threads(target: Callable[[int], object], count: int, timeout_s: float) -> list[BaseException]:
    """`target(i)` run in threads i = 0 .. count - 1 at once (each joined within `timeout_s`):
    what they raised, and a TimeoutError naming any still running."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - the caller reports them
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    if stuck:  # a thread that never returned is a failure too, not a silence
        errors.append(TimeoutError(f"threads {stuck} of {count} still running after {timeout_s:g}s"))
    return errors


def test_the_url_defaults_to_sqlite_in_the_state_dir_and_the_env_var_wins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.state.db import DATABASE_URL_ENV, connect, database_url, dialect_of

    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)
    monkeypatch.setenv("GANGSERVE_STATE_DIR", str(tmp_path / "state"))
    assert database_url() == f"sqlite://{tmp_path}/state/jobs.sqlite"  # the name existing state dirs have
    assert database_url(tmp_path) == f"sqlite://{tmp_path}/jobs.sqlite"
    db = connect()
    assert db.dialect == "sqlite" and db.path == tmp_path / "state" / "jobs.sqlite" and db.path.exists()
    db.close()
    monkeypatch.setenv(DATABASE_URL_ENV, "postgresql://u:p@db.internal:5432/gangserve")
    assert database_url(tmp_path) == "postgresql://u:p@db.internal:5432/gangserve"
    assert dialect_of("postgres://h/db") == "postgresql"
    with pytest.raises(ValueError) as info:
        dialect_of("mysql://root:hunter22@h/db")
    assert "mysql://***@h/db" in str(info.value) and "hunter22" not in str(info.value)
    with pytest.raises(ValueError, match="absolute path"):
        connect("sqlite://relative/jobs.sqlite")


@pytest.mark.parametrize(("url", "shown"), [
    # The state database's URLs ...
    ("postgresql://gs:pa55word@db:5432/state", "postgresql://***@db:5432/state"),
    ("postgresql://gs@db/state", "postgresql://***@db/state"),
    ("postgresql://db/state?user=gs&password=pa55word&sslmode=require",
     "postgresql://db/state?user=gs&password=***&sslmode=require"),
    ("postgresql://db/state?sslpassword=k3y&passfile=/etc/pgpass&sslkey=/k.pem",
     "postgresql://db/state?sslpassword=***&passfile=***&sslkey=***"),
    ("postgresql://gs:p%40ss%3Aword@db/state", "postgresql://***@db/state"),
    ("sqlite:///var/lib/gangserve/jobs.sqlite", "sqlite:///var/lib/gangserve/jobs.sqlite"),
    # ... and the artifact store's and an S3 endpoint's: one rule.
    ("s3://AKIA123:topsecret@bucket/prefix", "s3://***@bucket/prefix"),
    ("s3://bucket/p?secret_key=topsecret&region=x&flag", "s3://bucket/p?secret_key=***&region=x&flag"),
    ("s3://bucket/p", "s3://bucket/p"),
    ("https://u:p@minio.internal:9000", "https://***@minio.internal:9000"),
    ("file:///srv/state", "file:///srv/state"),
])
def test_every_url_has_one_redaction_rule(url: str, shown: str) -> None:
    from service.state import artifacts, db, urls

    assert urls.redact(url) == shown
    assert db.redact is urls.redact and artifacts.redact is urls.redact


def test_driver_messages_are_scrubbed_of_the_password_as_written_and_decoded() -> None:
    from service.state.urls import secrets_of

    assert secrets_of("postgresql://gs:p%40ss%3Aword@db/state?sslpassword=k3y2") == ["p%40ss%3Aword", "p@ss:word", "k3y2"]
    assert secrets_of("postgresql://gs@db/state") == []


# ---- start-up errors -------------------------------------------------------------------------

def test_an_unreachable_postgres_is_a_clear_error_naming_the_redacted_url() -> None:
    from service.weights.record import WeightsRecord
    from service.state.db import StateUnavailable, connect
    from service.training.store import JobStore

    url = f"postgresql://gs:topsecret-pw@127.0.0.1:{free_port()}/state"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(StateUnavailable) as info:
        JobStore(url)
    assert time.monotonic() - started < 10
    message = info.value.message
    assert (info.value.status, info.value.code) == (503, "state_unavailable")
    assert f"postgresql://***@127.0.0.1:{url.rsplit(':', 1)[1].split('/')[0]}" in message, message
    assert "topsecret-pw" not in message and "refused" in message.lower(), message
    with pytest.raises(StateUnavailable):
        connect(url)
    # The GangServer's record (its replica's start-up) fails the same way.
    with pytest.raises(StateUnavailable, match=r"postgresql://\*\*\*@127\.0\.0\.1"):
        WeightsRecord(Path("/nonexistent-state-dir"), url)


def test_a_sqlite_file_that_cannot_be_opened_is_a_clear_error(tmp_path: Path) -> None:
    from service.state.db import StateUnavailable, sqlite_url
    from service.training.store import JobStore

    missing = tmp_path / "no-such-dir" / "jobs.sqlite"
    with pytest.raises(StateUnavailable) as info:
        JobStore(sqlite_url(missing))
    assert str(missing) in info.value.message and info.value.code == "state_unavailable"


def test_connections_opening_a_fresh_sqlite_file_together_all_open(tmp_path: Path) -> None:
    """Several connections opening a new file at once race to switch it to WAL; SQLite answers
    the losers SQLITE_BUSY at once, without its busy handler (one fresh file in 10 to 40 with
    four openers here: the old code failed within 150 files in 5 runs of 5). Every opener
    waits its turn within the busy timeout instead, and a file held past that timeout is a
    clear error that says so, in bounded time."""
    from service.state.db import StateUnavailable, open_sqlite

    for trial in range(150):
        path = tmp_path / f"fresh-{trial}.sqlite"
        start = threading.Barrier(4)

        def open_and_close(_: int, path: Path = path, start: threading.Barrier = start) -> None:
            start.wait(timeout=10)
            for _ in range(3):
                conn, mode = open_sqlite(path, busy_timeout_s=10.0)
                assert mode == "wal"
                conn.close()

        errors = errors_of_threads(open_and_close, 4, timeout_s=60)
        assert not errors, f"fresh file {trial}: {errors}"

    held = tmp_path / "held.sqlite"
    holder = sqlite3.connect(str(held), isolation_level=None)
    holder.execute("PRAGMA journal_mode=WAL")
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("CREATE TABLE t (x INTEGER)")  # takes the exclusive lock and keeps it
    began = time.monotonic()
    with pytest.raises(StateUnavailable, match=r"still busy after 0\.3s"):
        open_sqlite(held, busy_timeout_s=0.3)
    assert time.monotonic() - began < 5.0
    holder.close()
    conn, _mode = open_sqlite(held, busy_timeout_s=0.3)  # free again
    conn.close()


def test_the_wrong_password_is_refused_without_printing_it(postgres_server: Any) -> None:
    from service.state.db import StateUnavailable, connect

    with pytest.raises(StateUnavailable) as info:
        connect(postgres_server.url(password="not-the-password"))
    assert "not-the-password" not in info.value.message and "***" in info.value.message
    assert "password authentication failed" in info.value.message


# ---- migrations ------------------------------------------------------------------------------

# The schema exactly as the code before service.state.db created it (no schema_version).
PRE_VERSIONING_SCHEMA = """
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
    job_id TEXT NOT NULL, epoch INTEGER NOT NULL, loss REAL, at REAL, PRIMARY KEY (job_id, epoch)
);
CREATE TABLE IF NOT EXISTS job_logs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, run_seq INTEGER, ts REAL NOT NULL,
    line TEXT NOT NULL, UNIQUE (job_id, run_seq)
);
CREATE TABLE IF NOT EXISTS managers (id TEXT PRIMARY KEY, heartbeat_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS datasets (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, created_at REAL NOT NULL,
    info TEXT NOT NULL, path TEXT NOT NULL, bytes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS served_weights (
    app TEXT NOT NULL, version INTEGER NOT NULL, source TEXT NOT NULL, description TEXT NOT NULL,
    job_id TEXT, checkpoint TEXT, sha256 TEXT NOT NULL, fingerprint TEXT NOT NULL,
    recorded_at REAL NOT NULL, superseded_at REAL, PRIMARY KEY (app, version)
);
CREATE TABLE IF NOT EXISTS gangs (
    app TEXT NOT NULL, replica_id TEXT NOT NULL, updated_at REAL NOT NULL, info TEXT NOT NULL,
    PRIMARY KEY (app, replica_id)
);
"""


def test_a_pre_versioning_sqlite_file_upgrades_in_place_with_every_row(tmp_path: Path) -> None:
    from service.weights.record import WeightsRecord
    from service.training.store import JobStore

    path = tmp_path / "jobs.sqlite"
    old = sqlite3.connect(path)
    old.executescript(PRE_VERSIONING_SCHEMA)
    old.execute("INSERT INTO jobs (id, status, spec, created_at, updated_at, progress, history, checkpoint, owner) "
                "VALUES ('job-old', 'SUCCEEDED', '{\"world_size\": 2}', 1.0, 2.0, '{\"epoch\": 1}', "
                "'[{\"epoch\": 1, \"loss\": 0.5}]', '{\"path\": \"checkpoints/job-old.safetensors\"}', 'mgr-x')")
    old.execute("INSERT INTO job_logs (job_id, run_seq, ts, line) VALUES ('job-old', 1, 1.5, 'old line')")
    old.execute("INSERT INTO datasets (id, created_at, info, path, bytes) VALUES ('ds-old', 1.0, '{\"kind\": \"linear\"}', "
                "'/x/ds-old.safetensors', 123)")
    old.execute("INSERT INTO served_weights VALUES ('app', 1, 'config', 'init=seed', NULL, NULL, 'aa', 'fp', 1.0, NULL), "
                "('app', 2, 'swap', 'job job-old', 'job-old', 'weights/bb.safetensors', 'bb', 'fp', 2.0, NULL)")
    old.execute("INSERT INTO gangs VALUES ('app', 'r1', 1.0, '{}')")
    old.commit()
    old.close()

    store = JobStore(path)
    record = WeightsRecord(tmp_path)
    # jobs: step 1 (the old schema, in place), then step 2 (init_from, resumes, eval_loss);
    # served_weights: step 1, then step 2 (eval_loss, rollback_of).
    assert store.database.schema_version("jobs") == 2 and store.database.schema_version("served_weights") == 2
    job = store.get_job("job-old")
    assert job is not None and job.status == "SUCCEEDED" and job.history == [{"epoch": 1, "loss": 0.5}]  # a legacy JSON history
    assert (job.init_from, job.resumes, job.resumed_from_epoch, job.final_eval_loss) == (None, 0, None, None)
    assert job.checkpoint == {"path": "checkpoints/job-old.safetensors"}
    assert store.tail_logs("job-old", 10) == [(1.5, "old line")]
    assert [d["id"] for d in store.list_datasets()] == ["ds-old"] and store.dataset_usage() == (1, 123)
    assert [(w.version, w.source, w.eval_loss, w.rollback_of) for w in record.history("app")] == [
        (1, "config", None, None), (2, "swap", None, None)]
    # New rows continue the old sequences.
    assert store.create_job(_job(7)).seq == 2
    assert record.record("app", "swap", "x", sha256="cc", fingerprint="fp", checkpoint=None).version == 3
    store.close()
    record.close()
    # Opening again applies nothing twice; tables this code does not own are left alone.
    again = JobStore(path)
    assert [r.id for r in again.list_jobs(10)[0]] == ["job-7", "job-old"]
    again.close()
    check = sqlite3.connect(path)
    assert check.execute("SELECT COUNT(*) FROM gangs").fetchone()[0] == 1
    # The version table of the code before Alembic is not written (Alembic's are the record).
    assert check.execute("SELECT name FROM sqlite_master WHERE name = 'schema_version'").fetchall() == []
    check.close()


def test_stores_opening_at_once_run_each_step_once_and_a_newer_schema_is_refused(store_url: str) -> None:
    """On both dialects: several stores opening a fresh database at the same time migrate it
    once (an ADD COLUMN run twice would fail); a database a newer gangserve migrated (a
    revision this code does not have, or, before Alembic, a higher number in the old version
    table) is a clear error, and so is a store without migrations."""
    import sqlalchemy as sa

    from service.state.db import SchemaTooNew, connect
    from service.training.store import JobStore

    errors = errors_of_threads(lambda _: JobStore(store_url).close(), 3, timeout_s=120)
    assert not errors, errors
    db = connect(store_url)
    assert db.schema_version("jobs") == 2 and db.schema_version("served_weights") == 0
    with db.session() as s:
        assert s.all("SELECT version_num FROM alembic_version_jobs") == [{"version_num": "jobs_0002"}]
        assert not sa.inspect(s.connection).has_table("schema_version")  # the old version table: never written
        s.execute("UPDATE alembic_version_jobs SET version_num = ?", ("jobs_0003",))  # a newer gangserve's step
    with pytest.raises(SchemaTooNew, match="schema version jobs_0003; this gangserve knows versions up to 2"):
        JobStore(store_url)
    with db.session() as s:  # the version record of the code before Alembic, from a newer one of that code
        s.execute("DROP TABLE alembic_version_jobs")
        s.execute("CREATE TABLE schema_version (store TEXT PRIMARY KEY, version INTEGER NOT NULL, updated_at REAL NOT NULL)")
        s.execute("INSERT INTO schema_version (store, version, updated_at) VALUES (?, ?, ?)", ("jobs", 3, 1.0))
    with pytest.raises(SchemaTooNew, match="schema version 3; this gangserve knows versions up to 2"):
        JobStore(store_url)
    with pytest.raises(ValueError, match="no migrations for store 'demo'"):
        db.migrate("demo")
    db.close()


def test_one_store_used_from_many_threads_at_once(store_url: str) -> None:
    """A Database is thread-safe: SQLite's one held connection (serialized) and PostgreSQL's
    pool (8 threads, 4 connections) both give every thread its own complete statements and
    transactions, and admission under the lock never overshoots."""
    from service.config.builder_args import TrainingLimits
    from service.training.limits import QuotaExceeded, check_job_fits
    from service.training.store import JobStore

    store = JobStore(store_url)
    limits = TrainingLimits(max_active_jobs=40, max_training_workers=80)
    refused: list[str] = []

    def worker(t: int) -> None:
        for i in range(10):
            job_id = f"{t}-{i}"
            try:
                store.create_job(_job_named(job_id), lambda usage: check_job_fits(limits, usage, 1, False))
            except QuotaExceeded:
                refused.append(job_id)
                continue
            got = store.get_job(job_id)
            assert got is not None and got.id == job_id
            assert store.update_job(job_id, progress={"epoch": 1, "epochs": 1, "step": i})

    errors = errors_of_threads(worker, 8, timeout_s=120)
    assert not errors, errors
    jobs, _ = store.list_jobs(200)
    assert len(jobs) == 40 and len(refused) == 40  # the quota held exactly
    assert len({j.seq for j in jobs}) == 40
    store.close()


def _job_named(job_id: str) -> Any:
    from service.training.store import JobRecord

    return JobRecord(id=job_id, status="PENDING", spec={"world_size": 1, "use_gpu": False}, created_at=1.0,
                     updated_at=1.0, progress={"epoch": 0, "epochs": 1, "step": 0})


# ---- a PostgreSQL server lost mid-run --------------------------------------------------------

def test_a_lost_postgres_gives_the_typed_error_and_everything_works_when_it_is_back(
        tmp_path: Path, postgres_server: Any) -> None:
    from service.weights.record import WeightsRecord
    from service.state.db import StateUnavailable
    from service.config.tunables import StateTunables
    from service.config.builder_args import TrainingLimits
    from service.training.limits import check_job_fits
    from service.training.store import JobStore

    url = postgres_server.create_database()
    store = JobStore(url)
    record = WeightsRecord(tmp_path, url)
    limits = TrainingLimits(max_active_jobs=2)
    store.create_job(_job(1))
    store.append_logs("job-1", [(1, 1.0, "before")])
    record.record("app", "swap", "v1", sha256="aa", fingerprint="f", checkpoint=None)

    postgres_server.stop()
    try:
        calls = [
            lambda: store.list_jobs(10),
            lambda: store.create_job(_job(2), lambda usage: check_job_fits(limits, usage, 1, False)),
            lambda: record.record("app", "swap", "v2", sha256="bb", fingerprint="f", checkpoint=None),
        ]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(StateUnavailable) as info:
                call()
            took = time.monotonic() - started
            assert took < StateTunables().pool_timeout_s + 5, took  # bounded: never a hang
            message = info.value.message
            assert (info.value.status, info.value.code, info.value.retry_after_s) == (503, "state_unavailable", 5.0)
            assert "postgresql://***@127.0.0.1" in message and "s3cret" not in message, message
    finally:
        postgres_server.start()

    # The same stores (their pools reconnect by themselves): everything works again.
    deadline = time.monotonic() + 30
    while True:
        try:
            jobs, _ = store.list_jobs(10)
            break
        except StateUnavailable:
            assert time.monotonic() < deadline, "the store did not recover within 30 s of the server's restart"
            time.sleep(0.5)
    assert [j.id for j in jobs] == ["job-1"] and jobs[0].status == "PENDING"  # nothing lost, nothing half-written
    assert store.tail_logs("job-1", 10) == [(1.0, "before")]
    store.create_job(_job(2), lambda usage: check_job_fits(limits, usage, 1, False))
    assert store.update_job("job-1", status="RUNNING")
    assert record.record("app", "swap", "v2", sha256="bb", fingerprint="f", checkpoint=None).version == 2
    assert [j.id for j in store.list_jobs(10)[0]] == ["job-2", "job-1"]
    store.close()
    record.close()
    postgres_server.drop_database(url)


def test_the_launcher_exits_non_zero_naming_the_redacted_url(tmp_path: Path) -> None:
    """`python -m service.launch` refuses to start (exit 4, before Ray starts) when the state
    database cannot be reached."""
    import os
    import subprocess
    import sys

    from harness.local import ROOT

    env = {**os.environ, "GANGSERVE_DATABASE_URL": f"postgresql://gs:launch-secret@127.0.0.1:{free_port()}/state",
           "GANGSERVE_STATE_DIR": str(tmp_path / "state")}
    done = subprocess.run([sys.executable, "-m", "service.launch", str(ROOT / "deployments" / "local.yaml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 4, (done.returncode, done.stderr[-2000:])
    assert "the state database cannot be used: cannot reach the state database postgresql://***@127.0.0.1" \
        in done.stderr, done.stderr[-2000:]
    assert "launch-secret" not in done.stderr + done.stdout


def test_the_job_managers_must_keep_writes_wait_for_the_database(postgres_server: Any, tmp_path: Path) -> None:
    """A job FAILED by the poller after its run was stopped (nobody polls it again) is not
    dropped while PostgreSQL is gone: it is kept, and written, in order after the job's earlier
    log line, by a later poll round once the database is back. The manager's own code
    (service.training.jobs.Jobs, the class the deployment wraps, without Serve or Ray) through
    its public calls, on a real server; the run actors are a stand-in whose kill takes the
    server away, so the FAIL that follows finds it gone."""
    from service.cluster.placement import ClusterSnapshot
    from service.config.builder_args import TrainingLimits
    from service.state.artifacts import open_store
    from service.state.db import StateUnavailable
    from service.training.jobs import Jobs
    from service.training.run_actors import RunActors
    from service.training.store import JobStore

    class RunsWhoseKillStopsTheDatabase(RunActors):
        async def launch(self, job_id: str, spec: dict[str, Any], dataset_path: str | None,
                         init_key: str | None, resume: dict[str, Any] | None = None) -> Any:
            return job_id  # the handle; no actor

        async def kill(self, handle: Any) -> None:  # type: ignore[override]
            await asyncio.to_thread(postgres_server.stop)

    url = postgres_server.create_database()
    store = JobStore(url)
    nodes = ClusterSnapshot(totals=[{"CPU": 4.0}], free=[{"CPU": 4.0}])
    manager = Jobs(store=store, artifacts=open_store(str(tmp_path / "artifacts"), local_state=tmp_path),
                   weights=None, limits=TrainingLimits(max_runtime_s=1), runs=RunsWhoseKillStopsTheDatabase("no-node"),
                   cluster=lambda: nodes)

    async def scenario() -> str:
        job = await manager.submit({"model": {"kind": "linear"}, "dataset": {"samples": 8}})
        await asyncio.sleep(1.2)  # past max_runtime_s
        try:
            await manager.poll_round()  # stops the run (the database goes), then FAILs the job: kept, no raise
            with pytest.raises(StateUnavailable):
                await manager.poll_round()  # still down: the kept write cannot be written yet
        finally:
            postgres_server.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                await manager.poll_round()  # writes the kept FAIL first
                return str(job["id"])
            except StateUnavailable:  # the pool reconnects within seconds
                assert time.monotonic() < deadline, "the kept write was not written within 30 s of the restart"
                await asyncio.sleep(0.5)

    job_id = asyncio.run(scenario())
    job = store.get_job(job_id)
    assert job is not None and job.status == "FAILED" and (job.error or "").startswith("exceeded max_runtime_s=1:")
    lines = [line for _, line in store.tail_logs(job_id, 10)]
    assert len(lines) == 2 and lines[0].startswith("submitted by") and lines[1] == f"FAILED: {job.error}", lines
    store.close()
    postgres_server.drop_database(url)
