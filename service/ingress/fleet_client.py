"""The ingress's view of the app's Controller: the fleet of gangs and the shared metrics.

Every call is bounded (`ingress.fleet_timeout_s`) and every failure is a GangServeError (503
`controller_unavailable`-style codes from service.ingress.handle_errors), so a controller
that is restarting makes `/gangs` answer 503 at once rather than hang; readiness then
falls back to asking a gang directly (service.ingress.readiness).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve.handle import DeploymentHandle

from service.errors import ErrorCode, GangServeError, GangUnavailable
from service.ingress.handle_errors import bounded_call
from service.tunables import Tunables

log = logging.getLogger("gangserve.ingress")

# Readiness asks with a short bound and falls back to a gang; status routes (/gangs,
# rollouts) have no fallback, so they wait longer (service.tunables says why each value).
# The controller timed out, is gone or pushes back (not an error it raised itself).
_CONTROLLER_AWAY = (ErrorCode.CONTROLLER_UNREACHABLE, ErrorCode.CONTROLLER_RESTARTING, ErrorCode.OVERLOADED)


class FleetClient:
    """Calls Controller methods for the ingress. With no handle (an API built without Serve,
    in unit tests) the fleet is empty and metrics are this process's only."""

    def __init__(self, handle: DeploymentHandle | None, tunables: Tunables = Tunables()) -> None:
        self._handle = handle
        self.tunables = tunables  # the deployed tree: its users on the ingress read it here
        self._t = tunables.ingress  # call bounds, the skip after a failure
        self._watch_max_s = tunables.fleet.watch_fleet_max_s  # how long the Controller holds a long poll
        self._skip_until = 0.0

    @property
    def connected(self) -> bool:
        return self._handle is not None

    async def view(self, for_readiness: bool = False) -> dict[str, Any]:
        """{"gangs": [/gang + replica_id, reported_s_ago], "ready": n, "lost": [...]}.

        `for_readiness`: bounded by ingress.readiness_timeout_s, and refused at once for a while
        after such a call failed (the caller has a fallback)."""
        if self._handle is None:
            return {"gangs": [], "ready": 0, "lost": []}
        if for_readiness:
            return await self._call("fleet", timeout_s=self._t.readiness_timeout_s, skip_after_failure=True)
        return await self._call("fleet")

    async def watch(self, known_version: int) -> dict[str, Any]:
        """The fleet view (as `view`, plus its "version") once it moved past `known_version`,
        or unchanged after `fleet.watch_fleet_max_s` (Controller.watch_fleet, a long poll)."""
        if self._handle is None:
            raise GangUnavailable("this application was deployed without a Controller; no fleet view",
                                  code=ErrorCode.CONTROLLER_UNREACHABLE)
        return await self._call("watch_fleet", known_version, self._watch_max_s,
                                timeout_s=self._watch_max_s + self._t.fleet_timeout_s)

    async def report_metrics(self, source: str, snapshot: dict[str, list]) -> None:
        if self._handle is not None:
            await self._call("report_metrics", source, snapshot)

    async def metrics(self, exclude: str | None) -> list[dict[str, list]]:
        """The other replicas' metric snapshots (and the retired counters of gone ones)."""
        if self._handle is None:
            return []
        return await self._call("metrics", exclude)

    async def weights_history(self) -> list[Any]:
        """Every recorded weights version of the app (service.weights.record.ServedWeights),
        oldest first; 503 `controller_*` when it cannot answer."""
        if self._handle is None:
            raise GangUnavailable("this application was deployed without a Controller; no weights record",
                                  code=ErrorCode.CONTROLLER_UNREACHABLE)
        return await self._call("weights_history")

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None,
                    skip_after_failure: bool = False) -> Any:
        assert self._handle is not None
        if skip_after_failure and time.monotonic() < self._skip_until:
            raise GangUnavailable(f"the controller failed a call less than {self._t.skip_after_failure_s:g}s ago",
                                  code=ErrorCode.CONTROLLER_UNREACHABLE, retry_after_s=1.0)
        try:
            return await bounded_call(self._handle, method, *args, what="controller",
                                      timeout_s=self._t.fleet_timeout_s if timeout_s is None else timeout_s,
                                      unavailable=_unavailable)
        except GangServeError as exc:
            if skip_after_failure and exc.code in _CONTROLLER_AWAY:
                self._skip_until = time.monotonic() + self._t.skip_after_failure_s
            raise


def _unavailable(message: str, code: ErrorCode, retry_after_s: float | None) -> GangServeError:
    return GangUnavailable(message, code=code, retry_after_s=retry_after_s or 1.0)

