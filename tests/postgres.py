"""The state-database tests' PostgreSQL (harness/postgres.py: a real server, no mocks).

`postgres_server` (session scope) is one server for the session, stopped and removed at its
end. Tests are skipped, with the reason, only where PostgreSQL is not installed (`make
install` installs it as root); a server that is installed but does not start fails them.

`store_url` (function scope, parametrized sqlite | postgresql) is a fresh, empty state
database: a new SQLite file, or a new database on the session's server.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from harness import postgres


class PostgresServer(postgres.PostgresServer):
    """harness.postgres.PostgresServer; skips the test where PostgreSQL cannot run here."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        try:
            super().__init__(*args, **kwargs)
        except postgres.PostgresUnavailable as exc:
            pytest.skip(str(exc))


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh state database URL of each dialect."""
    if request.param == "sqlite":
        from service.state.db import sqlite_url

        yield sqlite_url(tmp_path / "jobs.sqlite")
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    url = server.create_database()
    try:
        yield url
    finally:
        deadline = time.monotonic() + 30
        while True:  # a test that stopped the server restarts it; wait until it answers
            try:
                server.drop_database(url)
                break
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
