"""The state database: where it is, how to connect, one transaction, versioned migrations.

`GANGSERVE_DATABASE_URL` selects the store (read here and nowhere else):

- unset: the SQLite file `jobs.sqlite` in the state dir (the embedded default; `make serve`
  needs nothing). SQLite is for ONE node: its file locking is unreliable on network file
  systems, so several hosts must not write one file;
- `sqlite:///ABSOLUTE/PATH`: that SQLite file;
- `postgresql://user:password@host:port/db` (or `postgres://`): PostgreSQL through
  psycopg 3, pooled (psycopg_pool), for clusters.

The contract every store (JobStore, WeightsRecord) is written against:

- SQL is written once, portable to both dialects, with `?` placeholders; `Session`
  converts them for psycopg. Rows come back as dicts (column name -> value).
- `Database.session()`: statements in autocommit (reads, single-statement writes).
- `Database.transaction(lock)`: one atomic read-then-write. SQLite: `BEGIN IMMEDIATE`
  (the file's write lock is taken at BEGIN, so writers are serialized). PostgreSQL: a
  transaction that first takes `pg_advisory_xact_lock(<lock>)`, so every writer of the
  same lock name is serialized across processes and hosts and sees what the previous one
  committed (READ COMMITTED, a fresh snapshot per statement). That is what keeps job
  admission against quotas and `max(version) + 1` correct with any number of writers.
  Readers never wait for the lock.
- `Database.migrate(store, migrations)`: numbered steps per store, recorded in the table
  `schema_version (store, version)`; applied under a lock, each store's steps once.
- Any failure to reach or use the database (refused connection, server gone, pool
  exhausted, busy past the timeout, disk I/O error) raises `StateUnavailable`: HTTP 503,
  code `state_unavailable`, with the redacted URL and the reason. The password is never
  printed (`redact`).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from service.errors import GangServeError
from service.state.paths import state_dir
from service.tunables import TUNABLES

log = logging.getLogger("gangserve.state")

DATABASE_URL_ENV = "GANGSERVE_DATABASE_URL"
# The default file's name is kept from before this module existed, so existing state dirs
# keep their records.
DEFAULT_DB_FILE = "jobs.sqlite"
JOURNAL_ENV = "GANGSERVE_SQLITE_JOURNAL"

# Every wait is bounded. SQLite's busy wait and PostgreSQL's lock and statement waits stay
# below the ingress's call timeout (service.tunables checks it), so the caller gets this
# module's 503 with a reason, not a timeout of its own.
SQLITE_BUSY_TIMEOUT_S = TUNABLES.state.sqlite_busy_timeout_s
CONNECT_TIMEOUT_S = TUNABLES.state.connect_timeout_s
POOL_TIMEOUT_S = TUNABLES.state.pool_timeout_s
POOL_RECONNECT_S = TUNABLES.state.pool_reconnect_s
PG_LOCK_TIMEOUT_MS = TUNABLES.state.pg_lock_timeout_ms
PG_STATEMENT_TIMEOUT_MS = TUNABLES.state.pg_statement_timeout_ms
PG_IDLE_IN_TRANSACTION_MS = TUNABLES.state.pg_idle_in_transaction_ms
POOL_MIN_SIZE = TUNABLES.state.pool_min_size
POOL_MAX_SIZE = TUNABLES.state.pool_max_size

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

    status, code = 503, "state_unavailable"
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


_SECRET_PARAMS = frozenset({"password", "passfile", "sslpassword"})


def redact(url: str) -> str:
    """`url` with its password (userinfo and `password=` query parameters) replaced by ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable database URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
        netloc = f"{userinfo}@{host}"
    query = parts.query
    if query:
        query = urlencode([(k, "***" if k.lower() in _SECRET_PARAMS else v)
                           for k, v in parse_qsl(query, keep_blank_values=True)], safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # nothing secret (urlunsplit would also drop sqlite:///'s empty host)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _secrets_of(url: str) -> list[str]:
    """The password strings in `url` (to scrub from driver messages, which may echo them)."""
    try:
        parts = urlsplit(url)
        found = [parts.password] if parts.password else []
        found += [v for k, v in parse_qsl(parts.query) if k.lower() in _SECRET_PARAMS and v]
    except ValueError:
        return []
    return [s for s in found if len(s) >= 3]


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


def open_sqlite(path: str | Path) -> tuple[sqlite3.Connection, str]:
    """A raw connection to the SQLite file `path` with this module's pragmas: (connection,
    journal mode in force). Autocommit (`isolation_level=None`: transactions are explicit),
    usable from any thread (callers serialize their use), busy wait SQLITE_BUSY_TIMEOUT_S.

    Raises StateUnavailable naming the file if it cannot be opened or set up."""
    path = Path(path)
    try:
        conn = sqlite3.connect(str(path), timeout=SQLITE_BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False)
        wanted, why = journal_mode_for(path)
        got = str(conn.execute(f"PRAGMA journal_mode={wanted.upper()}").fetchone()[0]).lower()
        if got != wanted:  # e.g. another connection holds the file in WAL mode right now
            log.warning("state database %s: asked for journal_mode %s (%s), SQLite kept %s", path, wanted, why, got)
        # NORMAL is durable in WAL mode; the rollback journal needs FULL not to lose commits.
        conn.execute("PRAGMA synchronous=" + ("NORMAL" if got == "wal" else "FULL"))
    except sqlite3.Error as exc:
        raise StateUnavailable(
            f"cannot open the state database sqlite://{path}: {type(exc).__name__}: {exc} "
            f"(the directory must exist and be writable; set {DATABASE_URL_ENV} to use another database)"
        ) from None
    log.debug("state database %s: journal_mode %s (%s)", path, got, why)
    return conn, got


# ---- placeholders and sessions ---------------------------------------------------------------

@functools.lru_cache(maxsize=512)
def _pg_sql(sql: str) -> str:
    """`?` placeholders -> psycopg's `%s` (a literal `%` doubled). Our SQL has no `?` or `%`
    inside string literals; keeping it that way is part of writing portable SQL here."""
    return sql.replace("%", "%%").replace("?", "%s")


def _sqlite_dict_row(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> Row:
    return {d[0]: v for d, v in zip(cursor.description, row)}


Trace = Callable[[str, tuple[Any, ...]], None]


class Session:
    """Statements on one connection, SQL written with `?` placeholders; rows are dicts.

    Obtained from `Database.session()` (autocommit) or `Database.transaction()` (atomic);
    valid only inside that `with` block and on the thread that entered it."""

    def __init__(self, conn: Any, dialect: Dialect, trace: Trace | None) -> None:
        self._conn, self.dialect, self._trace = conn, dialect, trace

    def _run(self, sql: str, params: Sequence[Any]) -> Any:
        params = tuple(params)
        if self._trace is not None:
            self._trace(sql, params)
        if self.dialect == "sqlite":
            return self._conn.execute(sql, params)
        return self._conn.execute(_pg_sql(sql), params)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; the number of rows it changed (-1 when not applicable)."""
        return int(self._run(sql, params).rowcount)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        for params in rows:
            self._run(sql, params)

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        """The first row (None if there is none). Reads the result to its end, so no
        statement stays in progress (an INSERT ... RETURNING is complete when this returns)."""
        rows = self._run(sql, params).fetchall()
        return rows[0] if rows else None

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return list(self._run(sql, params).fetchall())

    def value(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first column of the first row (None when there is no row)."""
        row = self.one(sql, params)
        return None if row is None else next(iter(row.values()))


# ---- migrations ------------------------------------------------------------------------------

# DDL tokens with a different spelling per dialect. `REAL` is 4 bytes in PostgreSQL, too
# little for a Unix timestamp: `{float}` is DOUBLE PRECISION there.
_DDL_TOKENS: dict[Dialect, dict[str, str]] = {
    "sqlite": {"serial_pk": "INTEGER PRIMARY KEY AUTOINCREMENT", "float": "REAL", "bigint": "INTEGER"},
    "postgresql": {"serial_pk": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
                   "float": "DOUBLE PRECISION", "bigint": "BIGINT"},
}


def ddl(statement: str, dialect: Dialect) -> str:
    """`statement` with `{serial_pk}`, `{float}` and `{bigint}` spelled for `dialect`."""
    return statement.format(**_DDL_TOKENS[dialect])


@dataclass(frozen=True)
class Migration:
    """Step `version` of a store's schema: DDL `statements` (see `ddl` for the tokens), then
    `run(session)` for data changes. Step 1 is written with IF NOT EXISTS so that files made
    before versioning existed (same tables, no `schema_version` row) upgrade in place."""

    version: int
    description: str
    statements: tuple[str, ...] = ()
    run: Callable[[Session], None] | None = None


_SCHEMA_VERSION_DDL = (
    "CREATE TABLE IF NOT EXISTS schema_version ("
    " store TEXT PRIMARY KEY, version INTEGER NOT NULL, updated_at {float} NOT NULL)"
)


# ---- the database ----------------------------------------------------------------------------

class Database:
    """A connection (SQLite) or a pool of them (PostgreSQL) to the state database.

    Thread-safe. `url` is the redacted URL (safe to log and to put in errors)."""

    dialect: Dialect
    url: str
    journal_mode: str | None = None  # SQLite only

    def __init__(self, raw_url: str) -> None:
        self.dialect = dialect_of(raw_url)
        self.url = redact(raw_url)
        self._raw_url = raw_url  # never printed: `url` is the redacted one
        self._secrets = _secrets_of(raw_url)
        self.trace: Trace | None = None  # tests: called with (sql, params) of every statement
        self._closed = False
        if self.dialect == "sqlite":
            self.path: Path | None = sqlite_path(raw_url)
            self._sqlite, self.journal_mode = open_sqlite(self.path)
            self._sqlite.row_factory = _sqlite_dict_row
            self._lock = threading.Lock()
        else:
            self.path = None
            self._pool = _open_pool(raw_url, self._scrub)
        # Set when a call found PostgreSQL unavailable: until a direct connection succeeds
        # again, calls fail at once with the server's reason instead of each waiting
        # POOL_TIMEOUT_S for a pooled connection that cannot come.
        self._pg_down = False

    # -- public ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """Statements in autocommit mode: each one is atomic on its own."""
        with self._errors():
            if self.dialect == "sqlite":
                with self._lock:
                    yield Session(self._sqlite, "sqlite", self.trace)
            else:
                self._check_back()
                with self._pool.connection(timeout=POOL_TIMEOUT_S) as conn:
                    yield Session(conn, "postgresql", self.trace)

    @contextlib.contextmanager
    def transaction(self, lock: str = "state") -> Iterator[Session]:
        """One atomic transaction: COMMIT when the block ends, ROLLBACK if it raises (the
        exception propagates). Writers that name the same `lock` are serialized (on SQLite
        every writer of the file is). Not re-entrant: never open a session or transaction
        of the same Database inside it."""
        with self._errors():
            if self.dialect == "sqlite":
                with self._lock:
                    self._sqlite.execute("BEGIN IMMEDIATE")
                    try:
                        yield Session(self._sqlite, "sqlite", self.trace)
                        self._sqlite.execute("COMMIT")
                    except BaseException:
                        # Also after a failed COMMIT (busy, I/O error): the transaction
                        # must not stay open on this shared connection.
                        if self._sqlite.in_transaction:
                            with contextlib.suppress(sqlite3.Error):
                                self._sqlite.execute("ROLLBACK")
                        raise
            else:
                self._check_back()
                with self._pool.connection(timeout=POOL_TIMEOUT_S) as conn, conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(lock),))
                    yield Session(conn, "postgresql", self.trace)

    def migrate(self, store: str, migrations: Sequence[Migration]) -> int:
        """Bring `store`'s tables to the newest of `migrations` (numbered 1, 2, ... in
        order); returns the version now in force. Concurrent migrators wait for each other
        (one lock), so each step runs once. SchemaTooNew if the database is ahead."""
        numbers = [m.version for m in migrations]
        if numbers != list(range(1, len(migrations) + 1)):
            raise ValueError(f"migrations of {store!r} must be numbered 1..{len(migrations)}, got {numbers}")
        with self.transaction(lock="schema_version") as s:
            s.execute(ddl(_SCHEMA_VERSION_DDL, self.dialect))
            current = int(s.value("SELECT version FROM schema_version WHERE store = ?", (store,)) or 0)
            if current > len(migrations):
                raise SchemaTooNew(
                    f"the state database {self.url} has store {store!r} at schema version {current}; this "
                    f"gangserve knows versions up to {len(migrations)}: run a newer gangserve"
                )
            for step in migrations[current:]:
                for statement in step.statements:
                    s.execute(ddl(statement, self.dialect))
                if step.run is not None:
                    step.run(s)
                log.info("state database %s: store %s migrated to version %d (%s)",
                         self.url, store, step.version, step.description)
            if len(migrations) != current:
                s.execute(
                    "INSERT INTO schema_version (store, version, updated_at) VALUES (?, ?, ?) "
                    "ON CONFLICT (store) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at",
                    (store, len(migrations), time.time()),
                )
        return len(migrations)

    def schema_version(self, store: str) -> int:
        """The version `store` is at (0: never migrated)."""
        with self.session() as s:
            if self.dialect == "sqlite":
                exists = s.value("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'")
            else:
                exists = s.value("SELECT 1 FROM information_schema.tables WHERE table_name = 'schema_version' "
                                 "AND table_schema = current_schema()")
            if not exists:
                return 0
            return int(s.value("SELECT version FROM schema_version WHERE store = ?", (store,)) or 0)

    def ping(self) -> None:
        """One round trip; StateUnavailable if the database cannot answer."""
        with self.session() as s:
            s.value("SELECT 1")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.dialect == "sqlite":
            with self._lock:
                self._sqlite.close()
        else:
            self._pool.close(timeout=CONNECT_TIMEOUT_S)

    def __repr__(self) -> str:
        return f"Database({self.url})"

    # -- internals ------------------------------------------------------------------------
    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Driver errors that mean 'the database is not reachable or usable now' become
        StateUnavailable; everything else (a constraint, a bug, the caller's own
        exceptions) passes unchanged."""
        try:
            yield
        except StateUnavailable:
            raise
        except Exception as exc:
            if not _is_unavailable(exc):
                raise
            if self.dialect == "postgresql":
                self._pg_down = True
            raise StateUnavailable(f"the state database {self.url} is unavailable: {self._reason(exc)}") from exc

    def _reason(self, exc: BaseException) -> str:
        """What went wrong, in one line. The pool's timeout says only that no connection came:
        then one direct attempt tells a server that is gone from a pool that is busy."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = f"{type(exc).__name__}: {self._scrub(first)}"
        if type(exc).__name__ != "PoolTimeout":
            return reason
        failed = self._probe()
        if failed is not None:
            return f"cannot connect: {failed}"
        return (f"no pooled connection came free within {POOL_TIMEOUT_S:g}s (all {POOL_MAX_SIZE} busy, "
                "or the server just came back)")

    def _probe(self) -> str | None:
        """None if a direct connection to PostgreSQL succeeds now, else why not (one line)."""
        import psycopg

        try:
            psycopg.connect(_conninfo(self._raw_url), connect_timeout=2).close()
        except psycopg.Error as exc:
            lines = str(exc).strip().splitlines()
            return self._scrub(lines[0] if lines else type(exc).__name__)
        return None

    def _check_back(self) -> None:
        """After a failure: fail fast (StateUnavailable with the server's reason) while the
        server still refuses a direct connection; once it accepts one, use the pool again."""
        if not self._pg_down:
            return
        failed = self._probe()
        if failed is not None:
            raise StateUnavailable(f"the state database {self.url} is unavailable: cannot connect: {failed}")
        self._pg_down = False


def _is_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.OperationalError):
        return True  # locked past the busy timeout, disk I/O error, unable to open ...
    try:
        import psycopg
    except ImportError:
        return False
    # OperationalError covers refused/lost connections, AdminShutdown, the pool's timeout,
    # lock_timeout and statement_timeout; InterfaceError a connection already closed.
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


def lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key for `name` (namespaced to gangserve)."""
    return int.from_bytes(hashlib.sha256(f"gangserve:{name}".encode()).digest()[:8], "big", signed=True)


def _conninfo(raw_url: str) -> str:
    return "postgresql://" + raw_url.split("://", 1)[1]  # libpq takes both schemes; be explicit


def _open_pool(raw_url: str, scrub: Callable[[str], str]) -> Any:
    """A psycopg_pool.ConnectionPool of autocommit, dict-row connections with bounded
    timeouts, opened only after one direct connection proved the server reachable (so the
    start-up error carries the server's own reason, not just 'pool timed out')."""
    import psycopg
    from psycopg.rows import dict_row
    from psycopg_pool import ConnectionPool

    url = redact(raw_url)
    conninfo = _conninfo(raw_url)
    options = (f"-c lock_timeout={PG_LOCK_TIMEOUT_MS} -c statement_timeout={PG_STATEMENT_TIMEOUT_MS} "
               f"-c idle_in_transaction_session_timeout={PG_IDLE_IN_TRANSACTION_MS}")
    kwargs = {"autocommit": True, "row_factory": dict_row, "connect_timeout": int(CONNECT_TIMEOUT_S),
              "options": options, "application_name": "gangserve"}
    try:
        psycopg.connect(conninfo, **kwargs).close()
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StateUnavailable(
            f"cannot reach the state database {url}: {scrub(first)} (start the server or fix {DATABASE_URL_ENV})"
        ) from None
    pool = ConnectionPool(
        conninfo, min_size=POOL_MIN_SIZE, max_size=POOL_MAX_SIZE, kwargs=kwargs, open=False,
        timeout=POOL_TIMEOUT_S, name="gangserve-state",
        # A connection the server dropped (restart, failover) is found before it is used.
        check=ConnectionPool.check_connection,
        reconnect_timeout=POOL_RECONNECT_S,
        reconnect_failed=lambda _pool: log.warning("state database %s: still unreachable", url),
    )
    try:
        pool.open(wait=True, timeout=POOL_TIMEOUT_S)
    except Exception as exc:
        pool.close(timeout=1.0)
        raise StateUnavailable(f"cannot open a connection pool to the state database {url}: "
                               f"{type(exc).__name__}: {scrub(str(exc))[:300]}") from None
    return pool


def connect(url: str | None = None, *, state: Path | None = None) -> Database:
    """Open the state database at `url` (default: `database_url(state)`).

    Raises StateUnavailable naming the redacted URL when it cannot be reached, and
    ValueError for a URL that is not sqlite:// or postgresql://."""
    raw = url if url is not None else database_url(state)
    dialect_of(raw)  # a clear ValueError before anything else
    return Database(raw)


class DatabaseStore:
    """Base of a store over the state database (the job store, the served-weights record):
    `_open` connects to a URL (or borrows an open Database, which `close` then leaves open)
    and applies the store's migrations; a failure there closes what it opened."""

    _db: Database
    _owned: bool

    def _open(self, database: str | Database, store: str, migrations: Sequence[Migration]) -> None:
        self._owned = not isinstance(database, Database)
        self._db = connect(database) if not isinstance(database, Database) else database
        try:
            self._db.migrate(store, migrations)
        except BaseException:
            self.close()
            raise

    @property
    def database(self) -> Database:
        return self._db

    def close(self) -> None:
        if self._owned:
            self._db.close()
