"""Why no gang serves, in needed-vs-available terms: the ingress's status for a gang that
is not there (no gang server answers), and what each missing gang of GET /gangs waits for.

When the GangServer replica is not answering (Serve still placing its bundles, the replica
restarting after rank 0 died, or a gang the cluster can never hold), the ingress reads the
cluster's resources (service.cluster.placement, one bounded read shared by every caller)
and says which: `unschedulable` (the cluster can never hold it, or `schedule_timeout_s`
passed without a ready gang) or `scheduling` (it can; the gang waits for its bundles).
"""
from __future__ import annotations

import time

from service.cluster.placement import (
    GangRequest,
    GangUnschedulable,
    SharedSnapshot,
    check_feasible,
    gang_request,
    waiting_reason,
)
from service.config.builder_args import AppConfig
from service.contract.errors import ErrorCode
from service.contract.gang_status import LostGangStatus, SynthesizedStatus


class Diagnosis:
    """The cluster's side of a gang's absence, for one ingress replica."""

    def __init__(self, config: AppConfig) -> None:
        t = config.tunables.ingress
        self._schedule_timeout_s = config.gang.schedule_timeout_s
        self._request = gang_request(config.gang)
        # Needed vs free: one bounded read of the GCS at a time, shared.
        self._snapshots = SharedSnapshot(max_age_s=t.snapshot_max_age_s, timeout_s=t.snapshot_timeout_s)
        self._created = time.monotonic()
        self._last_ready: float | None = None

    def saw_ready(self) -> None:
        """A gang was seen serving: the schedule timeout counts from now."""
        self._last_ready = time.monotonic()

    async def diagnose(self, what: str) -> SynthesizedStatus:
        """The status of a gang that is not there (`what` says how we know): unschedulable,
        past `schedule_timeout_s` without a ready gang, or scheduling."""
        snapshot = await self._snapshots.get()  # None: unknown (the GCS is slow), never a wait past its bound
        since = self._last_ready if self._last_ready is not None else self._created
        waited = time.monotonic() - since
        if snapshot is not None:
            try:
                check_feasible(snapshot, self._request)
            except GangUnschedulable as unschedulable:
                return SynthesizedStatus(state="unschedulable", code=ErrorCode.UNSCHEDULABLE,
                                         reason=unschedulable.message)
        waiting = waiting_reason(snapshot, self._request, self._snapshots.why_none)
        if waited > self._schedule_timeout_s:
            return SynthesizedStatus(
                state="unschedulable", code=ErrorCode.SCHEDULE_TIMEOUT,
                reason=f"gave up after {waited:.0f}s (schedule_timeout_s={self._schedule_timeout_s:g}): {waiting}")
        return SynthesizedStatus(state="scheduling", code=ErrorCode.GANG_SCHEDULING,
                                 reason=f"{what}, {waited:.0f}s without a ready gang; {waiting}")

    async def not_started(self, placed: int, desired: int, lost: list[LostGangStatus]) -> list[str]:
        """GET /gangs `missing`, for the desired gangs beyond the `placed` ones: what each waits
        for (one gang's bundles against the cluster's free resources)."""
        if placed >= desired:
            return []
        snapshot = await self._snapshots.get()
        one = GangRequest(self._request.world_size, self._request.bundle, self._request.strategy)
        recently = f" (gang {lost[0].replica_id} was lost {lost[0].s_ago:g}s ago: {lost[0].reason})" if lost else ""
        waiting = waiting_reason(snapshot, one, self._snapshots.why_none)
        return [f"gang {i + 1} of {desired}: not started{recently}; {waiting}" for i in range(placed, desired)]
