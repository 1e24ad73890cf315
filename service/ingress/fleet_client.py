"""The ingress's view of the app's Controller: the fleet of gangs and the shared metrics.

Everything about the fleet view lives here: reading it (`view`, GET /gangs' `gangs` with the
desired count and what each missing gang waits for), following it (`follow`: the
Controller's long poll, so the request path reads a pushed status, `pushed_gang`, instead of
asking the gang server), the weights history and the metric snapshots.

Every call is bounded (`ingress.fleet_timeout_s`) and every failure is a GangServeError (503
`controller_unavailable`-style codes from service.ingress.handle_errors), so a controller
that is restarting makes `/gangs` answer 503 at once rather than hang; readiness then
falls back to asking a gang directly (service.ingress.readiness).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from service.config.builder_args import AppConfig
from service.contract.errors import ErrorCode, GangServeError, GangUnavailable
from service.contract.gang_status import FleetView, GangRow, GangState, GangsView, ObservedState
from service.ingress.diagnosis import Diagnosis
from service.ingress.handle_errors import bounded_call

log = logging.getLogger("gangserve.ingress")

# Readiness asks with a short bound and falls back to a gang; status routes (/gangs,
# rollouts) have no fallback, so they wait longer (service.config.tunables says why each value).
# The controller timed out, is gone or pushes back (not an error it raised itself).
_CONTROLLER_AWAY = (ErrorCode.CONTROLLER_UNREACHABLE, ErrorCode.CONTROLLER_RESTARTING, ErrorCode.OVERLOADED)


class FleetClient:
    """Calls Controller methods for the ingress. With no handle (an API built without Serve,
    in unit tests) the fleet is empty and metrics are this process's only."""

    def __init__(self, handle: DeploymentHandle | None, config: AppConfig, app_name: str | None = None) -> None:
        """`app_name`: the Serve application (whose GangServer target is the desired count)."""
        self._handle = handle
        self._cfg = config
        self._app = app_name
        self.tunables = config.tunables  # the deployed tree: its users on the ingress read it here
        self._t = config.tunables.ingress  # call bounds, the skip after a failure
        self._watch_max_s = config.tunables.fleet.watch_fleet_max_s  # how long the Controller holds a long poll
        self._skip_until = 0.0
        self.diagnosis = Diagnosis(config)  # why a gang is missing (shared with the request policy)
        self._desired_cache: tuple[float, int] | None = None
        # The pushed view is fresh while the Controller's long poll can still answer.
        self._follow_fresh_s = self._watch_max_s + self._t.fleet_timeout_s
        self._follower: asyncio.Task | None = None
        self._pushed: FleetView | None = None
        self.pushed_at = 0.0  # time.monotonic() when the long poll last answered (0: not following)

    @property
    def connected(self) -> bool:
        return self._handle is not None

    async def view(self, for_readiness: bool = False) -> FleetView:
        """Every gang's row (its latest report and its age), how many are ready, the
        lost ones (service.state.fleet.Fleet.view).

        `for_readiness`: bounded by ingress.readiness_timeout_s, and refused at once for a while
        after such a call failed (the caller has a fallback)."""
        if self._handle is None:
            return FleetView(gangs=[], ready=0, lost=[], controller_up_s=None, version=-1)
        if for_readiness:
            return await self._call("fleet", timeout_s=self._t.readiness_timeout_s, skip_after_failure=True)
        return await self._call("fleet")

    async def watch(self, known_version: int) -> FleetView:
        """The fleet view once its version moved past `known_version`, or unchanged after
        `fleet.watch_fleet_max_s` (Controller.watch_fleet, a long poll)."""
        if self._handle is None:
            raise GangUnavailable("this application was deployed without a Controller; no fleet view",
                                  code=ErrorCode.CONTROLLER_UNREACHABLE)
        return await self._call("watch_fleet", known_version, self._watch_max_s,
                                timeout_s=self._watch_max_s + self._t.fleet_timeout_s)

    async def gangs(self, for_readiness: bool = False) -> GangsView:
        """GET /gangs: the view, the desired count, and `missing`: for each desired gang that
        is not serving, what it waits for (503 if the Controller cannot answer)."""
        view = await self.view(for_readiness)
        desired = await self._desired()
        missing = await self.diagnosis.not_started(len(view.gangs), desired, view.lost)
        missing += [f"gang {g.replica_id}: {g.state}: {g.reason}" for g in view.gangs if g.state is not GangState.READY]
        return GangsView(desired=desired, ready=view.ready, gangs=view.gangs, missing=missing, lost=view.lost,
                         controller_up_s=view.controller_up_s)

    async def _desired(self) -> int:
        """Gangs the app should have: num_replicas, or Serve's current target when autoscaling."""
        if self._cfg.gang.autoscaling_config is None:
            return self._cfg.gang.num_replicas
        now = time.monotonic()
        if self._desired_cache and now - self._desired_cache[0] < self._t.desired_max_age_s:
            return self._desired_cache[1]
        try:
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), self._t.fleet_timeout_s)
            states = status.applications[self._app].deployments["GangServer"].replica_states
            desired = max(self._cfg.gang.min_gangs, sum(states.values()))
        except Exception:  # the controller is busy or restarting: the floor is still right
            desired = self._cfg.gang.min_gangs
        self._desired_cache = (now, desired)
        return desired

    # -- the pushed view -------------------------------------------------------------------
    def follow(self) -> None:
        """Follow the Controller's fleet view from now on (idempotent; no Controller: no-op)."""
        if self._handle is not None and (self._follower is None or self._follower.done()):
            self._follower = asyncio.get_running_loop().create_task(self._follow())

    def _current(self) -> FleetView | None:
        """The pushed view while it is current (the Controller's long poll can still answer)."""
        if self._pushed is None or time.monotonic() - self.pushed_at > self._follow_fresh_s:
            return None
        return self._pushed

    def rank0_nodes(self) -> frozenset[str] | None:
        """The nodes of every gang's rank 0 in the pushed view while it is current (a gang the
        fleet cannot reach included: Serve's router may still send it a call), None when the
        view is not current: the nodes a handle call's gang may be on."""
        view = self._current()
        return None if view is None else frozenset(row.ranks[0].node_id for row in view.gangs if row.ranks)

    def pushed_gang(self, single_gang: bool) -> GangRow | None:
        """The status a request acts on, from the pushed view while it is current: a ready gang
        if any (with several, Serve's router picks among the ready ones); with one gang, that
        gang in any state it reported. None when the view is not current, or names no gang to
        show: a row the Controller could not confirm (`unreachable`) is not shown, and the gang
        server's own answer decides then (it may well reach this ingress)."""
        view = self._current()
        if view is None:
            return None
        ready = [row for row in view.gangs if row.state is GangState.READY]
        if ready:
            return ready[0]
        reported = [row for row in view.gangs if row.state is not ObservedState.UNREACHABLE]
        return reported[0] if single_gang and reported else None

    async def _follow(self) -> None:
        """Every change of a gang's state, generation, weights or placement arrives at once.
        While the Controller cannot answer (it restarts), the view is not current, and the
        request path asks the gang server itself."""
        version = -1
        while True:
            try:
                view = await self.watch(version)
            except Exception as exc:  # noqa: BLE001 - the follower must outlive any one failure
                if not isinstance(exc, GangServeError):
                    log.exception("the fleet view's long poll failed")
                log.info("not following the fleet view for %.0fs: %s", self._t.skip_after_failure_s, exc)
                self._pushed, self.pushed_at = None, 0.0
                await asyncio.sleep(self._t.skip_after_failure_s)
                continue
            version, self._pushed, self.pushed_at = view.version, view, time.monotonic()

    async def report_metrics(self, source: str, snapshot: dict[str, list]) -> None:
        if self._handle is not None:
            await self._call("report_metrics", source, snapshot)

    async def metrics(self, exclude: str | None) -> list[dict[str, list]]:
        """The other replicas' metric snapshots (and the retired counters of gone ones)."""
        if self._handle is None:
            return []
        return await self._call("metrics", exclude)

    async def weights_history(self) -> list[Any]:
        """Every recorded weights version of the app (service.weights.served.ServedWeights),
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

