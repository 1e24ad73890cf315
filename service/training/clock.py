"""The job manager's clock: wall time (records, runtime limits), monotonic time (the poll
loop's intervals) and its sleeps. A dependency of service.training.jobs.Jobs, so a test can
pass one it controls; `SYSTEM_CLOCK` is the real one."""
from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """What Jobs reads the time through."""

    def time(self) -> float:
        """Wall-clock seconds since the epoch (the records' timestamps)."""
        ...

    def monotonic(self) -> float:
        """Seconds that never go backwards (intervals between polls, heartbeats, adoptions)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` (the poll loop's period, the late sweeps' pauses)."""
        ...


class SystemClock:
    """The process's clocks and asyncio's sleep."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK = SystemClock()
