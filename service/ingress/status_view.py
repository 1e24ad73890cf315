"""The ingress's view of the gang's status: the one owner of what state the gang is in and
how fresh that knowledge is.

It reads the status from three sources, best first: the Controller's pushed fleet view
(service.ingress.fleet_client.FleetClient.pushed_gang), the gang server's own `describe`,
and, when no gang server answers, a diagnosis from the cluster's resources
(service.ingress.diagnosis). A status from before the last failure it was told of (a
route, the replica, a request, a weights swap: `look_again`) is never acted on.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Protocol

from service.cluster.placement import GangUnschedulable
from service.contract.errors import GangServeError, GangUnavailable, gang_state_code
from service.contract.gang_status import AbsentState, AnyGangStatus, GangState, GangStatus, SynthesizedStatus
from service.ingress.fleet_client import FleetClient


class StatusObserver(Protocol):
    """Who chooses its route from each status adopted (service.transport.link.GangLink), and
    when it last lost one."""

    route_lost_at: float

    def observe(self, status: AnyGangStatus, fleet_rank0_nodes: frozenset[str] | None) -> None: ...


class GangStatusView:
    """The gang's status at most a given age old (see the module docstring)."""

    def __init__(self, describe: Callable[[], Awaitable[GangStatus]], fleet: FleetClient, observer: StatusObserver,
                 replica_lost_at: Callable[[], float], *, single_gang: bool, describe_timeout_s: float) -> None:
        self._describe = describe  # the gang server's own report (bounded by the caller)
        self._fleet = fleet
        self._diagnosis = fleet.diagnosis
        self._observer = observer
        self._replica_lost_at = replica_lost_at
        self._single_gang = single_gang
        self._describe_timeout_s = describe_timeout_s
        self._status: AnyGangStatus | None = None
        self._status_at = 0.0
        self._stale_since = 0.0  # statuses from before this are not acted on (a failure, a swap)
        self._refresh: asyncio.Task | None = None

    @property
    def seen_ready(self) -> bool:
        """The last status adopted said the gang serves."""
        return self._status is not None and self._status.state is GangState.READY

    def look_again(self) -> None:
        """The next read is fresh (pushed after now, or the gang server's own)."""
        self._stale_since = time.monotonic()

    async def read(self, max_age_s: float) -> AnyGangStatus:
        """The gang's status, at most `max_age_s` old: the Controller's pushed view while it is
        current and names a gang, else the gang server's own `describe` (refreshed in the
        background when stale), or a diagnosis when no gang server answers. `max_age_s <= 0`:
        always the gang server's own, fresh."""
        self._fleet.follow()
        # A route, the replica or a request failed since: only a status from after it counts.
        stale_since = max(self._stale_since, self._replica_lost_at(), self._observer.route_lost_at)
        if max_age_s > 0 and self._fleet.pushed_at > stale_since:
            pushed = self._fleet.pushed_gang(self._single_gang)
            if pushed is not None:
                self._adopt(pushed)
                return pushed
        age = time.monotonic() - self._status_at if self._status_at > stale_since else float("inf")
        if self._status is None or max_age_s <= 0 or age == float("inf"):
            return await self._refresh_status()
        if age > max_age_s and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_status())
        if age > 5 * max_age_s + self._describe_timeout_s:  # far too stale to trust: wait for fresh
            return await self._refresh_status()
        return self._status

    async def read_by(self, deadline: float, max_age_s: float) -> AnyGangStatus | None:
        """`read(max_age_s)`, or None when it is not there by `deadline` (monotonic): a request
        never waits on a status read past its own bound."""
        bound = asyncio.timeout(max(0.0, deadline - time.monotonic()))
        try:
            async with bound:
                return await self.read(max_age_s=max_age_s)
        except TimeoutError:
            if not bound.expired():
                raise  # not ours
            return None

    async def _refresh_status(self) -> AnyGangStatus:
        status: AnyGangStatus
        try:
            status = await self._describe()
        except GangServeError as exc:
            status = await self._diagnosis.diagnose(f"gang server not answering ({exc.message})")
        self._adopt(status)
        self._status_at = time.monotonic()
        return status

    def _adopt(self, status: AnyGangStatus) -> None:
        """`status` is the gang's status from now on (the observer chooses its route from it,
        and, with several gangs, from where the fleet view has every gang's rank 0: None when
        the view is not current; with one gang, the status is all there is: no other nodes)."""
        self._observer.observe(status, frozenset() if self._single_gang else self._fleet.rank0_nodes())
        if status.state is GangState.READY:
            self._diagnosis.saw_ready()
        self._status = status


def unavailable_error(status: AnyGangStatus, reason: str | None = None) -> GangServeError:
    """The 503 a request gets from a gang in `status` (`reason`: its reason as shown, e.g.
    with paths redacted): the synthesized status's own code, else the code of its state."""
    reason = status.reason if reason is None else reason
    code = status.code if isinstance(status, SynthesizedStatus) else gang_state_code(status.state)
    if status.state is AbsentState.UNSCHEDULABLE:
        return GangUnschedulable(reason, code=code)
    return GangUnavailable(f"gang is {status.state.value}: {reason}", code=code)
