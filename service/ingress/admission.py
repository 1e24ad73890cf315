"""Admission of requests that wait for a gang: an inference that arrives while no gang can
serve waits for one (one status poll at a time) instead of getting 503 at once, at most
`max_queued_requests` of them at a time, and never past its deadline."""
from __future__ import annotations

import asyncio

from service.contract.errors import ErrorCode, GangUnavailable
from service.contract.gang_status import AbsentState, AnyGangStatus, GangState
from service.ingress.outages import OutageEstimate
from service.ingress.status_view import unavailable_error
from service.ingress.waits import DropReason, count_drop, pause


class Admission:
    """Which requests wait for a gang, and how many at a time."""

    def __init__(self, outages: OutageEstimate, *, single_gang: bool, max_queued_requests: int,
                 poll_s: float) -> None:
        self._outages = outages
        self._single_gang = single_gang
        self._limit = max_queued_requests  # < 0: no limit
        self._poll_s = poll_s
        self.waiting = 0  # requests waiting for a gang now

    def must_wait(self, status: AnyGangStatus) -> bool:
        """Whether a request that waits for a gang must wait on `status`. The status is one
        gang's: with several gangs, one broken or rebuilding gang says nothing about the
        others (the router sends to ready ones; a broken one answers 503 at once), so only
        the app-wide states (the ingress's own: scheduling, unschedulable) wait then."""
        return status.state is not GangState.READY and (self._single_gang or isinstance(status.state, AbsentState))

    async def wait(self, status: AnyGangStatus, deadline: float) -> None:
        """Wait one poll for a gang to serve again (the caller looks at the status again).
        503 when the gang can never be placed, when the wait would outlast the deadline
        (OutageEstimate.check) or when `max_queued_requests` requests wait already; 504
        `deadline_exceeded` when the deadline passes meanwhile."""
        if status.state is AbsentState.UNSCHEDULABLE:
            raise unavailable_error(status)
        self._outages.saw_failure()
        why = f"gang is {status.state.value}: {status.reason}"
        self._outages.check(why, deadline)
        if 0 <= self._limit <= self.waiting:
            raise GangUnavailable(f"{why}; {self.waiting} requests already wait for it "
                                  f"(max_queued_requests={self._limit})", code=ErrorCode.OVERLOADED, retry_after_s=1.0)
        self.waiting += 1
        try:
            await pause(self._poll_s, deadline, f"waiting for a gang ({why})")
        except asyncio.CancelledError:
            count_drop(DropReason.DISCONNECTED)
            raise
        finally:
            self.waiting -= 1
