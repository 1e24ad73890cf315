"""A real PostgreSQL server for the state-database tests and benchmarks (no mocks).

`postgres_server` (session scope) runs Debian's `initdb` + `postgres` from
/usr/lib/postgresql/*/bin in a fresh directory under /tmp, listening on 127.0.0.1 only on a
free port, with password (scram) authentication, so URLs carry a password to redact. As
root it runs as the `postgres` system user (postgres refuses to run as root). It is stopped
and its directory removed at the end of the session. Tests are skipped, with the reason,
only where PostgreSQL is not installed (`make install` installs it as root); a server that
is installed but does not start fails the tests.

Where PostgreSQL is not installed (or cannot run as root), `PostgresUnavailable` says why;
tests/postgres.py turns that into a skip.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from harness.local import free_port

PG_USER = "gangserve"
PG_PASSWORD = "s3cret-pw-for-tests"
START_TIMEOUT_S = 60


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


class PostgresUnavailable(RuntimeError):
    """PostgreSQL cannot be run here; the message says what is missing."""


class PostgresServer:
    """One postgres process on 127.0.0.1:`port` with its data in `base`; stop/start it at will
    (the lost-database tests do)."""

    def __init__(self, listen: str = "127.0.0.1", allow_cidr: str | None = None) -> None:
        """`listen`: the address(es) postgres binds (comma-separated, e.g. loopback plus a
        test network's gateway); `allow_cidr`: a network whose clients may log in with the
        password (besides loopback)."""
        self.listen = listen
        bin_dir = _bin_dir()
        if bin_dir is None:
            raise PostgresUnavailable("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/postgres); "
                        "`make install` installs Debian's postgresql when run as root")
        self.bin = bin_dir
        self._as: list[str] = []
        owner = None
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresUnavailable("running as root and there is no `postgres` system user to run postgres as "
                            "(postgres refuses to run as root; Debian's postgresql package creates it)")
            self._as = ["runuser", "-u", "postgres", "--"]
        self.base = Path(tempfile.mkdtemp(prefix="gangserve-pg-"))
        self.data = self.base / "data"
        if owner is not None:
            os.chown(self.base, owner.pw_uid, owner.pw_gid)
        pwfile = self.base / "pw"
        pwfile.write_text(PG_PASSWORD + "\n")
        if owner is not None:
            os.chown(pwfile, owner.pw_uid, owner.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", PG_USER, f"--pwfile={pwfile}", "--auth-host=scram-sha-256",
                  "--auth-local=trust", "-E", "UTF8", "--no-sync")
        if allow_cidr is not None:
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {allow_cidr} scram-sha-256\n")
        self.port = free_port()
        self.start()

    def _run(self, tool: str, *args: str, timeout: float = START_TIMEOUT_S) -> str:
        cmd = [*self._as, str(self.bin / tool), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.base)
        if done.returncode != 0:
            log = (self.base / "log").read_text()[-2000:] if (self.base / "log").exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-2000:]}\n{log}")
        return done.stdout

    def start(self) -> None:
        options = (f"-p {self.port} -c listen_addresses={self.listen} -c unix_socket_directories={self.base} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=60")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.base / "log"), "-o", options,
                  "-w", "-t", str(START_TIMEOUT_S), "start")

    def stop(self) -> None:
        """Fast shutdown: open connections are cut, as when a database server goes away."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", str(START_TIMEOUT_S), "stop")

    def url(self, database: str = "postgres", password: str = PG_PASSWORD, host: str = "127.0.0.1") -> str:
        return f"postgresql://{PG_USER}:{password}@{host}:{self.port}/{database}"

    def create_database(self, host: str = "127.0.0.1") -> str:
        """A new empty database; its URL (through `host`, one of the listen addresses)."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name, host=host)

    def drop_database(self, url: str) -> None:
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def close(self) -> None:
        try:
            self.stop()
        except Exception:  # noqa: BLE001 - already stopped (a test stopped it) is fine
            pass
        shutil.rmtree(self.base, ignore_errors=True)


