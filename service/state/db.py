"""The state database: where it is, how to connect, one transaction, versioned migrations.

`GANGSERVE_DATABASE_URL` selects the store (read here and nowhere else):

- unset: the SQLite file `jobs.sqlite` in the state dir (the embedded default; `make serve`
  needs nothing). SQLite is for ONE node: its file locking is unreliable on network file
  systems, so several hosts must not write one file;
- `sqlite:///ABSOLUTE/PATH`: that SQLite file;
- `postgresql://user:password@host:port/db` (or `postgres://`): PostgreSQL through
  psycopg 3 (the libpq URL as given: every libpq parameter works), pooled, for clusters.

Built on SQLAlchemy Core (an Engine per Database: the pysqlite and psycopg dialects, the
connection pool, transactions) and Alembic (the migrations, `service/state/migrations/`).
The contract every store (JobStore, WeightsRecord) is written against:

- SQL is written once, portable to both dialects, with `?` placeholders; `Session` passes
  it to the driver as written (no compilation per statement), as `%s` for psycopg. Rows
  come back as dicts (column name -> value).
- `Database.session()`: statements in autocommit (reads, single-statement writes).
- `Database.transaction(lock)`: one atomic read-then-write. SQLite: `BEGIN IMMEDIATE`
  (the file's write lock is taken at BEGIN, so writers are serialized). PostgreSQL: a READ
  COMMITTED transaction that first takes `pg_advisory_xact_lock(<lock>)`, so every writer of
  the same lock name is serialized across processes and hosts and sees what the previous
  one committed (a fresh snapshot per statement). That is what keeps job admission against
  quotas and `max(version) + 1` correct with any number of writers. Readers never wait for
  the lock.
- `Database.migrate(store)`: the store's Alembic branch to its head, under one lock, each
  step once; a database migrated by the code before Alembic (table `schema_version`) or
  before versioning (the same tables, no version at all) is adopted in place.
- Any failure to reach or use the database (refused connection, server gone, pool
  exhausted, busy past the timeout, disk I/O error) raises `StateUnavailable`: HTTP 503,
  code `state_unavailable`, with the redacted URL and the reason. Calls fail fast while the
  server is away (each one tries one fresh connection, bounded by the connect timeout) and
  work again, in the same process, as soon as it is back. The password is never printed
  (`redact`, the one rule of service.state.urls).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, Sequence

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import QueuePool, StaticPool

from service.contract.errors import ErrorCode, GangServeError
from service.state.paths import state_dir
from service.state.urls import redact, secrets_of
from service.config.tunables import StateTunables

if TYPE_CHECKING:
    from alembic.script import ScriptDirectory

__all__ = [
    "DATABASE_URL_ENV", "Database", "DatabaseStore", "Row", "SchemaTooNew", "Session", "StateUnavailable",
    "connect", "database_url", "dialect_of", "filesystem_type", "journal_mode_for", "redact", "sqlite_url",
]

log = logging.getLogger("gangserve.state")

DATABASE_URL_ENV = "GANGSERVE_DATABASE_URL"
# The default file's name is kept from before this module existed, so existing state dirs
# keep their records.
DEFAULT_DB_FILE = "jobs.sqlite"
JOURNAL_ENV = "GANGSERVE_SQLITE_JOURNAL"
MIGRATIONS_DIR = Path(__file__).with_name("migrations")

# Every wait is bounded, by the state tunables a Database is opened with. SQLite's busy wait
# and PostgreSQL's lock and statement waits stay below the ingress's call timeout
# (AppConfig's validator checks it), so the caller gets this module's 503 with a reason, not
# a timeout of its own.

Dialect = Literal["sqlite", "postgresql"]
Row = dict[str, Any]

# File systems on which SQLite's WAL is unsafe (its -shm index is memory shared between
# processes on ONE host) and file locking is at best advisory: network, cluster and FUSE
# file systems. Any "fuse.*" type (sshfs, s3fs, gcsfuse, juicefs ...) counts too.
SHARED_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
    "afs", "ocfs2", "gfs2", "9p", "virtiofs", "orangefs", "pvfs2", "panfs", "wekafs", "davfs", "fuse", "fuseblk",
})


class StateUnavailable(GangServeError):
    """The state database cannot be reached or used right now (503 `state_unavailable`).

    Raised at start-up (the message names the redacted URL: fix it, or start the server) and
    mid-run (the server went away, the file is locked past the busy timeout): nothing was
    written by the failed call, and the same call works again once the database is back.
    """

    status, code = 503, ErrorCode.STATE_UNAVAILABLE
    retry_after_s = 5.0


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer gangserve than this one."""


# ---- the URL ---------------------------------------------------------------------------------

def database_url(state: Path | None = None) -> str:
    """`GANGSERVE_DATABASE_URL`, else `sqlite:///<state dir>/jobs.sqlite` (`state` if given,
    else the process's state dir)."""
    url = os.environ.get(DATABASE_URL_ENV, "").strip()
    if url:
        return url
    return sqlite_url((state or state_dir()) / DEFAULT_DB_FILE)


def sqlite_url(path: str | os.PathLike[str]) -> str:
    """`sqlite:///ABSOLUTE/PATH` of `path` (resolved)."""
    return "sqlite://" + str(Path(path).resolve())


def dialect_of(url: str) -> Dialect:
    """'sqlite' or 'postgresql'; ValueError (naming the redacted URL) for anything else."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "sqlite":
        return "sqlite"
    if scheme in ("postgresql", "postgres"):
        return "postgresql"
    raise ValueError(
        f"{DATABASE_URL_ENV}={redact(url)!r}: expected sqlite:///ABSOLUTE/PATH or "
        "postgresql://user:password@host:port/db"
    )


def sqlite_path(url: str) -> Path:
    """The file of a `sqlite:///ABSOLUTE/PATH` URL."""
    rest = url.split("://", 1)[1]
    if not rest.startswith("/"):
        raise ValueError(f"{DATABASE_URL_ENV}={url!r}: a SQLite URL needs an absolute path (sqlite:///ABSOLUTE/PATH)")
    return Path(rest)


# ---- SQLite: journal mode --------------------------------------------------------------------

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
    """("wal" | "delete", why): WAL on a local disk, the rollback journal on a shared one
    (WAL's index is shared memory, which processes on different hosts cannot share).
    `GANGSERVE_SQLITE_JOURNAL=wal|delete` overrides the detection."""
    forced = os.environ.get(JOURNAL_ENV, "").strip().lower()
    if forced in ("wal", "delete"):
        return forced, f"{JOURNAL_ENV}={forced}"
    fstype = filesystem_type(Path(db_path).parent, mounts)
    if is_shared_fs(fstype):
        return "delete", (f"{fstype} is a network/shared file system: rollback journal; SQLite on it is "
                          f"for one node (use {DATABASE_URL_ENV}=postgresql://... for several)")
    return "wal", f"local file system ({fstype or 'type unknown'})"


def open_sqlite(path: str | Path, busy_timeout_s: float) -> tuple[sqlite3.Connection, str]:
    """A raw connection to the SQLite file `path` with this module's pragmas: (connection,
    journal mode in force). Driver autocommit (`isolation_level=None`: transactions are
    explicit `BEGIN IMMEDIATE`s), usable from any thread (callers serialize their use),
    busy wait `busy_timeout_s` (the state tunable sqlite_busy_timeout_s).

    Raises StateUnavailable naming the file if it cannot be opened or set up: at once for an
    error other than busy, and for busy once `busy_timeout_s` has passed (a try that started
    before then may still spend its own busy wait: at most twice that in all)."""
    path = Path(path)
    deadline = time.monotonic() + busy_timeout_s
    pause_s = 0.005
    while True:
        try:
            return _open_sqlite_once(path, busy_timeout_s)
        except sqlite3.Error as exc:
            # Switching a new file to WAL needs its exclusive lock, and SQLite answers a
            # connection that loses that race SQLITE_BUSY at once, without its busy handler:
            # 4 connections opening a fresh file together met it on ~1 file in 8 here (never
            # on a file already in WAL). Waiting it out is what the busy timeout would do.
            busy = isinstance(exc, sqlite3.OperationalError) and _is_busy(exc)
            if not busy or time.monotonic() + pause_s > deadline:
                raise StateUnavailable(
                    f"cannot open the state database sqlite://{path}: {type(exc).__name__}: {exc}"
                    + (f" (still busy after {busy_timeout_s:g}s)" if busy else "")
                    + f" (the directory must exist and be writable; set {DATABASE_URL_ENV} to use another database)"
                ) from None
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 0.1)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    """SQLITE_BUSY or SQLITE_LOCKED, extended codes included (the primary code is the low byte)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _open_sqlite_once(path: Path, busy_timeout_s: float) -> tuple[sqlite3.Connection, str]:
    """One try of `open_sqlite`; sqlite3.Error as SQLite raised it (the connection closed)."""
    conn = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    try:
        wanted, why = journal_mode_for(path)
        got = str(conn.execute(f"PRAGMA journal_mode={wanted.upper()}").fetchone()[0]).lower()
        if got != wanted:  # e.g. another connection holds the file in WAL mode right now
            log.warning("state database %s: asked for journal_mode %s (%s), SQLite kept %s", path, wanted, why, got)
        # NORMAL is durable in WAL mode; the rollback journal needs FULL not to lose commits.
        conn.execute("PRAGMA synchronous=" + ("NORMAL" if got == "wal" else "FULL"))
    except BaseException:
        conn.close()
        raise
    log.debug("state database %s: journal_mode %s (%s)", path, got, why)
    return conn, got


# ---- sessions --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=512)
def _pg_sql(sql: str) -> str:
    """`?` placeholders -> psycopg's `%s` (a literal `%` doubled). Our SQL has no `?` or `%`
    inside string literals; keeping it that way is part of writing portable SQL here."""
    return sql.replace("%", "%%").replace("?", "%s")


Trace = Callable[[str, tuple[Any, ...]], None]


class Session:
    """Statements on one connection, SQL written with `?` placeholders; rows are dicts.

    Obtained from `Database.session()` (autocommit) or `Database.transaction()` (atomic);
    valid only inside that `with` block and on the thread that entered it. `connection` is
    the SQLAlchemy Connection (for Core statements and Alembic, in the same transaction)."""

    def __init__(self, connection: sa.Connection, dialect: Dialect, trace: Trace | None) -> None:
        self.connection, self.dialect, self._trace = connection, dialect, trace

    def _run(self, sql: str, params: Sequence[Any]) -> sa.CursorResult[Any]:
        params = tuple(params)
        if self._trace is not None:
            self._trace(sql, params)
        return self.connection.exec_driver_sql(sql if self.dialect == "sqlite" else _pg_sql(sql), params)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; the number of rows it changed (-1 when not applicable)."""
        return int(self._run(sql, params).rowcount)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one statement once per parameter row (the driver's executemany)."""
        batch = [tuple(params) for params in rows]
        if not batch:
            return
        if self._trace is not None:
            for params in batch:
                self._trace(sql, params)
        self.connection.exec_driver_sql(sql if self.dialect == "sqlite" else _pg_sql(sql), batch)

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        """The first row (None if there is none). Reads the result to its end, so no
        statement stays in progress (an INSERT ... RETURNING is complete when this returns)."""
        rows = self.all(sql, params)
        return rows[0] if rows else None

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Every row of the result."""
        result = self._run(sql, params)
        keys = tuple(result.keys())
        return [dict(zip(keys, row)) for row in result.fetchall()]

    def value(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first column of the first row (None when there is no row)."""
        row = self._run(sql, params).fetchone()
        return None if row is None else row[0]


# ---- migrations ------------------------------------------------------------------------------

# The version record of the code before Alembic: read once, to adopt such a database; never written.
_LEGACY_VERSIONS = "schema_version"


@functools.cache
def _scripts() -> ScriptDirectory:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(MIGRATIONS_DIR))


def _number(store: str, revision: str) -> int | None:
    """N of the revision id `<store>_<NNNN>`; None for an id that is not of that form."""
    match = re.fullmatch(re.escape(store) + r"_(\d{4})", revision)
    return int(match.group(1)) if match else None


def _revision_number(store: str, revision: str) -> int | None:
    """N of `revision` (an id, or `<store>@head`) if it is one of this code's revisions of
    `store`, else None (a newer gangserve wrote it, or the store has no migrations)."""
    from alembic.util import CommandError

    try:
        found = _scripts().get_revision(revision)
    except CommandError:
        return None
    return None if found is None else _number(store, found.revision)


def version_table(store: str) -> str:
    """The Alembic version table of `store` (one per store: their versions are independent)."""
    return f"alembic_version_{store}"


# ---- the database ----------------------------------------------------------------------------

class Database:
    """A SQLAlchemy Engine on the state database: one shared connection (SQLite, statements
    serialized by a lock, as the file serializes writers anyway) or a pool of them
    (PostgreSQL: up to the state tunable pool_max_size, each checked with a round trip before use).

    Thread-safe. `url` is the redacted URL (safe to log and to put in errors); `engine` the
    Engine (for SQLAlchemy Core; use `session`/`transaction` to keep this module's errors)."""

    dialect: Dialect
    url: str
    engine: sa.Engine
    path: Path | None  # the SQLite file (None on PostgreSQL)
    journal_mode: str | None = None  # SQLite only

    def __init__(self, raw_url: str, tunables: StateTunables | None = None) -> None:
        """Open the engine and prove the database answers (StateUnavailable naming the
        redacted URL and why, ValueError for a URL that is not sqlite:// or postgresql://).
        `tunables`: the waits and pool sizes (default: the state tunables' defaults)."""
        self.tunables = tunables = tunables or StateTunables()
        self.dialect = dialect_of(raw_url)
        self.url = redact(raw_url)
        self._secrets = secrets_of(raw_url)
        self.trace: Trace | None = None  # tests: called with (sql, params) of every statement
        self._closed = False
        self._lock: threading.Lock | None = None
        self._held: sa.Connection | None = None  # SQLite's one Connection
        if self.dialect == "sqlite":
            self.path = sqlite_path(raw_url)
            conn, self.journal_mode = open_sqlite(self.path, tunables.sqlite_busy_timeout_s)
            self._lock = threading.Lock()
            # One connection (StaticPool), held open by one SQLAlchemy Connection that every
            # session and transaction uses in turn, under `_lock` (no pool checkout per call);
            # driver autocommit, so `transaction` sends its own BEGIN IMMEDIATE.
            self.engine = sa.create_engine("sqlite+pysqlite://", creator=lambda: conn, poolclass=StaticPool,
                                           isolation_level="AUTOCOMMIT")
        else:
            self.path = None
            self.engine = _pg_engine(raw_url, tunables)
        try:
            # The first connection: the dialect's set-up, and the start-up error with the
            # server's own reason; PostgreSQL's first pool_min_size connections stay pooled.
            if self.dialect == "sqlite":
                self._held = self.engine.connect()
            else:
                with contextlib.ExitStack() as opened:
                    for _ in range(max(1, tunables.pool_min_size)):
                        opened.enter_context(self.engine.connect())
        except sa_exc.DBAPIError as exc:
            self.engine.dispose()
            raise StateUnavailable(f"cannot reach the state database {self.url}: {self._reason(exc)} "
                                   f"(start the server or fix {DATABASE_URL_ENV})") from None

    # -- public ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """Statements in autocommit mode: each one is atomic on its own."""
        with self._errors(), self._connection() as conn:
            yield Session(conn, self.dialect, self.trace)

    @contextlib.contextmanager
    def transaction(self, lock: str = "state") -> Iterator[Session]:
        """One atomic transaction: COMMIT when the block ends, ROLLBACK if it raises (the
        exception propagates; also after a failed COMMIT, so no transaction stays open on a
        connection). Writers that name the same `lock` are serialized (on SQLite every writer
        of the file is). Not re-entrant: never open a session or transaction of the same
        Database inside it."""
        with self._errors(), self._connection() as conn:
            if self.dialect == "sqlite":
                # SQLAlchemy's transaction is bookkeeping here (the driver is in autocommit):
                # BEGIN IMMEDIATE opens SQLite's, the driver's commit()/rollback() end it.
                with conn.begin():
                    conn.exec_driver_sql("BEGIN IMMEDIATE")
                    yield Session(conn, "sqlite", self.trace)
            else:
                conn.execution_options(isolation_level="READ COMMITTED")
                with conn.begin():
                    conn.exec_driver_sql("SELECT pg_advisory_xact_lock(%s)", (lock_key(lock),))
                    yield Session(conn, "postgresql", self.trace)

    def migrate(self, store: str) -> int:
        """Bring `store`'s tables to the head of its Alembic branch; returns the version now
        in force (N of `<store>_<NNNN>`). Concurrent migrators wait for each other (one
        lock) and the steps run in that one transaction, so each step runs once, all or
        nothing. A database of the code before Alembic (no Alembic version of the store) is
        adopted: its `schema_version` number is stamped as the revision of that number, then
        upgraded; that table is left as it was. SchemaTooNew if the database is ahead of this code."""
        from alembic import command
        from alembic.config import Config
        from alembic.runtime.migration import MigrationContext

        head_number = _revision_number(store, f"{store}@head")
        if head_number is None:
            raise ValueError(f"no migrations for store {store!r} in {MIGRATIONS_DIR} (revisions <store>_<NNNN>)")
        table = version_table(store)
        with self.transaction(lock="schema_version") as s:  # the lock's name predates Alembic: keep it
            conn = s.connection
            current = MigrationContext.configure(conn, opts={"version_table": table}).get_current_revision()
            legacy = 0
            if current is None and sa.inspect(conn).has_table(_LEGACY_VERSIONS):
                legacy = int(s.value(f"SELECT version FROM {_LEGACY_VERSIONS} WHERE store = ?", (store,)) or 0)
            number = legacy if current is None else _revision_number(store, current)
            if number is None or number > head_number:
                shown = current if number is None else number
                raise SchemaTooNew(
                    f"the state database {self.url} has store {store!r} at schema version {shown}; this gangserve "
                    f"knows versions up to {head_number}: run a newer gangserve"
                )
            if number != head_number or current is None:
                config = Config()
                config.set_main_option("script_location", str(MIGRATIONS_DIR))
                config.attributes.update(connection=conn, version_table=table)
                if current is None and legacy:
                    command.stamp(config, f"{store}_{legacy:04d}")  # migrated by the code before Alembic
                command.upgrade(config, f"{store}@head")
                log.info("state database %s: store %s migrated from version %d to %d",
                         self.url, store, number or 0, head_number)
        return head_number

    def schema_version(self, store: str) -> int:
        """The version `store` is at (0: never migrated by this code; `migrate` adopts a
        database of the code before Alembic)."""
        from alembic.runtime.migration import MigrationContext

        with self.session() as s:
            current = MigrationContext.configure(s.connection, opts={"version_table": version_table(store)}) \
                .get_current_revision()
            return 0 if current is None else _number(store, current) or 0

    def ping(self) -> None:
        """One round trip; StateUnavailable if the database cannot answer."""
        with self.session() as s:
            s.value("SELECT 1")

    def close(self) -> None:
        """Close every connection (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._lock is None:
            self.engine.dispose()
            return
        with self._lock:
            if self._held is not None:
                self._held.close()
            self.engine.dispose()

    def __repr__(self) -> str:
        return f"Database({self.url})"

    # -- internals ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _connection(self) -> Iterator[sa.Connection]:
        """A Connection for one session or transaction: PostgreSQL's from the pool (returned,
        reset, when the block ends); SQLite's held one, under the lock, its SQLAlchemy
        transaction bookkeeping ended when the block ends (the driver is in autocommit)."""
        if self._lock is None:
            with self.engine.connect() as conn:
                yield conn
            return
        with self._lock:
            assert self._held is not None
            try:
                yield self._held
            finally:
                if self._held.in_transaction():
                    self._held.rollback()  # a session's autobegin; a transaction has ended its own

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Errors that mean 'the database is not reachable or usable now' become
        StateUnavailable; everything else (a constraint, a bug, the caller's own
        exceptions) passes unchanged."""
        try:
            yield
        except StateUnavailable:
            raise
        except Exception as exc:
            if not _is_unavailable(exc):
                raise
            raise StateUnavailable(f"the state database {self.url} is unavailable: {self._reason(exc)}") from exc

    def _reason(self, exc: BaseException) -> str:
        """What went wrong, in one line: the driver's own error (not SQLAlchemy's wrapper, whose
        text carries the statement and its parameters), with any password scrubbed."""
        if isinstance(exc, sa_exc.TimeoutError):
            t = self.tunables
            return f"no pooled connection came free within {t.pool_timeout_s:g}s (all {t.pool_max_size} busy)"
        orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None else exc
        text = str(orig).strip()
        return f"{type(orig).__name__}: {self._scrub(text.splitlines()[0] if text else '')}"


def _is_unavailable(exc: BaseException) -> bool:
    # OperationalError covers refused/lost connections, AdminShutdown, lock_timeout and
    # statement_timeout (psycopg) and busy / disk I/O / unable to open (SQLite); InterfaceError
    # a connection already closed; TimeoutError the pool's wait.
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError, sqlite3.OperationalError)):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated


def lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key for `name` (namespaced to gangserve)."""
    return int.from_bytes(hashlib.sha256(f"gangserve:{name}".encode()).digest()[:8], "big", signed=True)


def _conninfo(raw_url: str) -> str:
    return "postgresql://" + raw_url.split("://", 1)[1]  # libpq takes both schemes; be explicit


def _pg_engine(raw_url: str, t: StateTunables) -> sa.Engine:
    """An Engine of psycopg connections made from the libpq URL as given, with bounded
    timeouts; autocommit unless a transaction asks otherwise. The pool opens connections on
    demand, keeps up to t.pool_max_size, waits t.pool_timeout_s for one to come free, and checks
    each before use (a connection the server dropped, at a restart or failover, is replaced,
    and while the server is away each call fails at once with its reason)."""
    import psycopg

    conninfo = _conninfo(raw_url)
    options = (f"-c lock_timeout={t.pg_lock_timeout_ms} -c statement_timeout={t.pg_statement_timeout_ms} "
               f"-c idle_in_transaction_session_timeout={t.pg_idle_in_transaction_ms}")
    kwargs: dict[str, Any] = {"connect_timeout": int(t.connect_timeout_s), "options": options,
                              "application_name": "gangserve"}
    return sa.create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(conninfo, **kwargs), poolclass=QueuePool,
        pool_size=t.pool_max_size, max_overflow=0, pool_timeout=t.pool_timeout_s, pool_pre_ping=True,
        isolation_level="AUTOCOMMIT",
    )


def connect(url: str | None = None, *, state: Path | None = None, tunables: StateTunables | None = None) -> Database:
    """Open the state database at `url` (default: `database_url(state)`), with the state
    `tunables` (default: their defaults).

    Raises StateUnavailable naming the redacted URL when it cannot be reached, and
    ValueError for a URL that is not sqlite:// or postgresql://."""
    raw = url if url is not None else database_url(state)
    dialect_of(raw)  # a clear ValueError before anything else
    return Database(raw, tunables)


class DatabaseStore:
    """Base of a store over the state database (the job store, the served-weights record):
    `_open` connects to a URL (or borrows an open Database, which `close` then leaves open)
    and migrates the store's tables; a failure there closes what it opened."""

    _db: Database
    _owned: bool

    def _open(self, database: str | Database, store: str, tunables: StateTunables | None = None) -> None:
        """`tunables`: the state tunables a Database opened here gets (a borrowed one has its own)."""
        self._owned = not isinstance(database, Database)
        self._db = connect(database, tunables=tunables) if not isinstance(database, Database) else database
        try:
            self._db.migrate(store)
        except BaseException:
            self.close()
            raise

    @property
    def database(self) -> Database:
        return self._db

    def close(self) -> None:
        """Close the Database if this store opened it."""
        if self._owned:
            self._db.close()
