"""Writes that must not be lost while the state database (or the artifact store) is away.

A job FAILED after its run was stopped, the outcome of a run that is gone, a manager log
line: nobody polls such a job again, so if its write is dropped the record is wrong forever.
`KeptWrites.run` tries the write at once; while the database is unavailable (or earlier kept
writes still wait) it is queued, in order, and `flush` (called by the job poller every
round) writes the queue front to back, stopping at the first that still cannot be written.
Each write must be idempotent or guard itself against running twice.
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

from service.state import artifacts
from service.state.db import StateUnavailable

log = logging.getLogger("gangserve.training")

Write = Callable[[], Awaitable[None]]


class KeptWrites:
    """An in-order queue of state writes waiting for the database to come back."""

    def __init__(self) -> None:
        self._queue: list[tuple[str, Write]] = []

    @property
    def pending(self) -> list[str]:
        """What each kept write is, oldest first."""
        return [what for what, _ in self._queue]

    async def run(self, what: str, write: Write) -> None:
        """Write now, or keep it (behind any kept earlier, so their order holds) while the
        database or the artifact store is unavailable. Other errors propagate."""
        if self._queue:
            self._queue.append((what, write))
            return
        try:
            await write()
        except (StateUnavailable, artifacts.StorageUnavailable) as exc:  # e.g. result.json unreadable
            log.warning("kept %s for later: %s", what, exc.message)
            self._queue.append((what, write))

    async def flush(self) -> None:
        """Write the kept writes in order; the first that fails again raises and stays first."""
        while self._queue:
            what, write = self._queue[0]
            await write()
            self._queue.pop(0)
            log.info("wrote %s (kept while the state database was unavailable)", what)
