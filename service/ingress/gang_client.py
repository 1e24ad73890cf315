"""The ingress's view of the GangServer: bounded handle calls, error mapping, and a
readiness picture that stays truthful while the gang server itself cannot answer.

When the GangServer replica is not answering (Serve still placing its bundles, the
replica restarting after rank 0 died, or a gang the cluster can never hold), the ingress
diagnoses why from the cluster's resources (service.cluster.placement) and answers 503 at
once with needed vs available, instead of letting requests queue in Serve's router.

Deadlines and in-service retry (issue 23). Every request carries a deadline
(service.deadlines) over the hop and into the gang's batcher. A request that fails
because its gang broke (RETRYABLE_CODES: a rank died, a collective timed out, the gang is
rebuilding or stopping, its replica is gone or restarting; never bad input, never the
deadline) is sent again: at once (with several gangs Serve's router picks a ready one),
or, with one gang, once it is ready again. A request that arrives while no gang can
serve waits for one instead of getting 503 at once, at most `max_queued_requests` of them
at a time. Waiting and retrying end at the request's deadline: 504 `deadline_exceeded`
then. 503 + Retry-After only when the gang is unschedulable, or when the expected wait
(the length of the last outage this ingress saw, ingress.default_outage_s before any) would end
after the deadline: the message says both. Inference is idempotent and every step runs
on one weights version across ranks (service.gang), so a retried answer is as right as
a first one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import numpy as np
import ray
from ray.exceptions import RayError, RayTaskError
from ray import serve
from ray.serve.handle import DeploymentHandle

from service.transport import shm
from service.transport.link import GangLink
from service.config import AppConfig
from service.deadlines import seconds_left
from service.errors import (RETRYABLE_CODES, CollectiveTimeout, DeadlineExceeded, DeadlineExceededBeforeStep,
                            ErrorCode, GangServeError, GangUnavailable, gang_state_code)
from service.cluster.placement import (
    GangRequest,
    GangUnschedulable,
    SharedSnapshot,
    check_feasible,
    gang_request,
    waiting_reason,
)
from service.metrics.process import process_metrics
from service.gang_status import GangStatus, dump
from service.ingress.fleet_client import FleetClient
from service.ingress.handle_errors import awaited, map_handle_error

log = logging.getLogger("gangserve.ingress")
T = TypeVar("T")

# Waits, retries and fallbacks (service.tunables says why each value).


class GangClient:
    """Calls GangServer methods; every wait is bounded and every failure is a GangServeError."""

    def __init__(self, handle: DeploymentHandle, config: AppConfig, fleet: FleetClient | None = None,
                 app_name: str | None = None, node_id: str | None = None) -> None:
        """`node_id`: the Ray node this client runs on (default: this process's); the link
        uses it to find rank 0 on the same node."""
        self._handle = handle
        self._cfg = config
        # Every gang of the app reports its status to the Controller (several gangs: num_replicas).
        self._app = app_name
        self._fleet = fleet or FleetClient(None)
        self._desired_cache: tuple[float, int] | None = None
        self._single_gang = config.single_gang
        self._request = gang_request(config)
        self._created = time.monotonic()
        self._last_ready: float | None = None
        self._status: dict[str, Any] | None = None
        self._status_at = 0.0
        self._status_pushed = False  # `_status` came from the Controller's pushed view
        self._follower: asyncio.Task | None = None  # follows the pushed view (`_follow_fleet`)
        self._pushed_at = 0.0  # when the long poll last answered
        self._refresh: asyncio.Task | None = None
        self._node_id = node_id or ray.get_runtime_context().get_node_id()
        self.tunables = config.tunables
        self._t = config.tunables.ingress  # status age, describe bound, retry backoff, waits
        # Needed vs free for diagnoses: one bounded read of the GCS at a time, shared.
        self._snapshots = SharedSnapshot(max_age_s=self._t.snapshot_max_age_s, timeout_s=self._t.snapshot_timeout_s)
        # The pushed view is fresh while the Controller's long poll can still answer.
        self._follow_fresh_s = config.tunables.fleet.watch_fleet_max_s + self._t.fleet_timeout_s
        shm_enabled = config.shm_transport and shm.available()
        # How requests reach rank 0: chosen per gang status, not per request (service.transport.link).
        self._link = GangLink(node_id=self._node_id, channel_enabled=config.uses_data_channel,
                              shm_enabled=shm_enabled, call=self._request_call, bounded=self._request_bounded,
                              on_route_lost=self._look_again, tunables=config.tunables.transport)
        self._waiting = 0  # requests waiting for a gang to serve (bounded by max_queued_requests)
        self._outage_since: float | None = None  # first failure of the current outage
        self._last_outage_s: float | None = None  # how long the last one lasted
        self.retries = 0  # requests this client retried (tests read it; the metric counts them too)
        for reason in ("deadline", "disconnected"):
            process_metrics().inc("gangserve_requests_dropped", ("ingress", reason), 0.0)
        if shm_enabled:
            shm.sweep_stale()  # files a crashed ingress on this node left behind

    # -- public ---------------------------------------------------------------------------
    async def infer(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    deadline: float | None = None) -> np.ndarray:
        """x [batch, seq, E] float32, key mask [batch, seq] bool (None: all tokens), causal
        (None: the served model's default) -> [batch, seq, E] float32, by `deadline`
        (time.monotonic(); None: `request_timeout_s` from now), retried while the gang is
        broken (see the module docstring)."""
        if deadline is None:
            deadline = time.monotonic() + self._cfg.request_timeout_s
        attempt = 0
        while True:
            # A gang seen not ready is looked at again sooner: a rebuild takes about a second,
            # and a 1 s old "broken" would hold requests for as long again after it.
            ready = (self._status or {}).get("state") == "ready"
            status = await self._status_by(
                deadline, self._t.wait_poll_s if attempt or not ready else self._t.status_max_age_s)
            if status is None:
                _count_drop("deadline")
                raise DeadlineExceededBeforeStep("the request's deadline passed while the ingress read the gang's "
                                                 "status; it was not computed")
            # The status is one gang's. With several gangs, one broken or rebuilding gang says
            # nothing about the others (the router sends to ready ones; a broken one answers 503
            # at once), so only app-wide conditions wait here.
            if status["state"] != "ready" and (
                self._single_gang or status["state"] in ("scheduling", "unschedulable")
            ):
                await self._wait_for_gang(status, deadline)
                continue
            try:
                out = await self._send_before(x, mask, causal, deadline)
            except GangServeError as exc:
                if exc.code not in RETRYABLE_CODES:
                    raise
                self._saw_outage()
                self._status_at = 0.0  # look at the gang again before the next try
                if self._single_gang:
                    self._check_wait(exc.message, deadline)
                delay = self._t.retry_backoff_s[min(attempt, len(self._t.retry_backoff_s) - 1)]
                attempt += 1
                self.retries += 1
                process_metrics().inc("gangserve_request_retries", (exc.code,))
                log.info("retrying a request (attempt %d) after %s: %s", attempt + 1, exc.code, exc.message)
                await _pause(delay, deadline, f"retrying after {exc.code}: {exc.message}")
                continue
            if self._outage_since is not None:  # served again: the outage is over
                self._last_outage_s, self._outage_since = time.monotonic() - self._outage_since, None
            return out

    async def _send_before(self, x: np.ndarray, mask: np.ndarray | None, causal: bool | None,
                           deadline: float) -> np.ndarray:
        """One request, sent on its own: the gang server's batcher (service.gang) is the one
        batcher on the path, so it sees every request (it shares steps among them, and Serve's
        autoscaler counts each one as an ongoing request of the gang). A request whose
        deadline has passed is not sent (504, counted as dropped at the ingress); one whose
        client went away while it waited for a gang is counted as disconnected."""
        if time.monotonic() >= deadline:
            _count_drop("deadline")
            raise DeadlineExceededBeforeStep("the request's deadline passed before it could be sent to the gang; "
                                             "it was not computed")
        return await self._link.infer(x, mask, causal, deadline)

    def _saw_outage(self) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()

    def _check_wait(self, why: str, deadline: float) -> None:
        """503 now (with the expected wait) when the gang is not expected back before `deadline`."""
        since = self._outage_since if self._outage_since is not None else time.monotonic()
        expected = max(0.0, (self._last_outage_s or self._t.default_outage_s) - (time.monotonic() - since))
        left = deadline - time.monotonic()
        if expected > left:
            raise GangUnavailable(
                f"no gang can serve now ({why}); one is expected in ~{expected:.1f}s (the last outage lasted "
                f"{self._last_outage_s or self._t.default_outage_s:.1f}s), after this request's deadline ({left:.2f}s left)",
                code=ErrorCode.DEADLINE_UNMEETABLE, retry_after_s=max(1.0, round(expected)))

    async def _wait_for_gang(self, status: dict[str, Any], deadline: float) -> None:
        """Wait one poll for a gang to serve again (the caller looks at the status again).
        503 when the gang can never be placed, when the wait would outlast the deadline
        (`_check_wait`) or when `max_queued_requests` requests wait already; 504
        `deadline_exceeded` when the deadline passes meanwhile."""
        if status["state"] == "unschedulable":
            raise unavailable_error(status)
        self._saw_outage()
        why = f"gang is {status['state']}: {status.get('reason', '')}"
        self._check_wait(why, deadline)
        limit = self._cfg.max_queued_requests
        if 0 <= limit <= self._waiting:
            raise GangUnavailable(f"{why}; {self._waiting} requests already wait for it "
                                  f"(max_queued_requests={limit})", code=ErrorCode.OVERLOADED, retry_after_s=1.0)
        self._waiting += 1
        try:
            await _pause(self._t.wait_poll_s, deadline, f"waiting for a gang ({why})")
        except asyncio.CancelledError:
            _count_drop("disconnected")
            raise
        finally:
            self._waiting -= 1

    async def reload_weights(self, checkpoint: str | None, job_id: str | None = None,
                             eval_loss: float | None = None) -> dict[str, Any]:
        """Hot-swap the gang to a dense checkpoint (None: back to the app's configured
        weights), recorded as the app's next weights version (with the job's final
        `eval_loss`, if any); returns the new /gang description. Bounded by ingress.swap_timeout_s."""
        self._status_at = 0.0  # the version changes: next status read is fresh
        return await self._call("reload_weights", checkpoint, job_id, eval_loss, timeout_s=self._t.swap_timeout_s)

    async def rollback_weights(self, version: int) -> dict[str, Any]:
        """Serve recorded weights `version` again (GangServer.rollback_weights), recorded as
        the app's next version; returns the new /gang description. Bounded by ingress.swap_timeout_s."""
        self._status_at = 0.0
        return await self._call("rollback_weights", version, timeout_s=self._t.swap_timeout_s)

    async def gangs(self, for_readiness: bool = False) -> dict[str, Any]:
        """Every live gang of the app: {"desired", "ready", "gangs": [/gang + replica_id],
        "missing", "lost"}, from the Controller's fleet view (503 if it cannot answer).

        `missing` names, for each desired gang that is not serving, what it waits for;
        `lost` the gangs whose replica process died recently (never counted as ready).
        """
        view = await self._fleet.view(for_readiness)
        rows, lost = view["gangs"], view["lost"]
        desired = await self._desired()
        ready = sum(1 for g in rows if g.get("state") == "ready")
        missing: list[str] = []
        if len(rows) < desired:
            snapshot = await self._snapshots.get()
            one = GangRequest(self._request.world_size, self._request.bundle, self._request.strategy)
            recently = f" (gang {lost[0]['replica_id']} was lost {lost[0]['s_ago']:g}s ago: {lost[0]['reason']})" \
                if lost else ""
            waiting = waiting_reason(snapshot, one, self._snapshots.why_none)
            missing = [f"gang {i + 1} of {desired}: not started{recently}; {waiting}"
                       for i in range(len(rows), desired)]
        missing += [f"gang {g['replica_id']}: {g.get('state')}: {g.get('reason')}" for g in rows
                    if g.get("state") != "ready"]
        # The rows are already GangStatus dicts (the fleet view validated each report).
        return {"desired": desired, "ready": ready, "gangs": rows, "missing": missing, "lost": lost,
                "controller_up_s": view.get("controller_up_s")}

    async def _desired(self) -> int:
        """Gangs the app should have: num_replicas, or Serve's current target when autoscaling."""
        if self._cfg.autoscaling_config is None:
            return self._cfg.num_replicas
        now = time.monotonic()
        if self._desired_cache and now - self._desired_cache[0] < 5.0:
            return self._desired_cache[1]
        try:
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), self._t.fleet_timeout_s)
            states = status.applications[self._app].deployments["GangServer"].replica_states
            desired = max(self._cfg.min_gangs, sum(states.values()))
        except Exception:  # the controller is busy or restarting: the floor is still right
            desired = self._cfg.min_gangs
        self._desired_cache = (now, desired)
        return desired

    async def describe(self) -> dict[str, Any]:
        """GangServer.describe, or a synthesized status explaining why it cannot answer;
        plus how this ingress replica has been handing tensors to the gang."""
        status = await self.status(max_age_s=0.0)
        return {**status, "ingress_transport": dump(self._link.transport())}

    async def status(self, max_age_s: float) -> dict[str, Any]:
        """The gang's status, at most `max_age_s` old: the Controller's pushed view while this
        client follows it and it names a gang (see `_follow_fleet`), else the gang server's
        own `describe` (refreshed in the background when stale), or a diagnosis when no gang
        server answers. `max_age_s <= 0`: always the gang server's own, fresh."""
        self._start_following()
        if max_age_s > 0 and self._status_pushed and self._status_at and self._following():
            return self._status  # type: ignore[return-value]  # current: every change is pushed
        age = time.monotonic() - self._status_at
        if self._status is None or max_age_s <= 0:
            return await self._refresh_status()
        if age > max_age_s and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_status())
        if age > 5 * max_age_s + self._t.describe_timeout_s:  # far too stale to trust: wait for fresh
            return await self._refresh_status()
        return self._status

    # -- internals ------------------------------------------------------------------------
    async def _status_by(self, deadline: float, max_age_s: float) -> dict[str, Any] | None:
        """`status(max_age_s)`, or None when it is not there by `deadline` (monotonic): a
        request never waits on a status read past its own bound."""
        bound = asyncio.timeout(max(0.0, deadline - time.monotonic()))
        try:
            async with bound:
                return await self.status(max_age_s=max_age_s)
        except TimeoutError:
            if not bound.expired():
                raise  # not ours
            return None

    def _request_call(self, method: str, *args: Any, deadline: float | None, **kwargs: Any) -> Awaitable[Any]:
        """The link's handle call: bounded like every request (`request_timeout_s`, the
        deadline, and the gang seen unable to answer)."""
        return self._call(method, *args, timeout_s=self._cfg.request_timeout_s, watch=True, deadline=deadline,
                          **kwargs)

    def _request_bounded(self, call: Awaitable[T], what: str, deadline: float | None) -> Awaitable[T]:
        """The link's wait for a call it made itself (the data channel), bounded the same way."""
        return self._bounded(call, what, self._cfg.request_timeout_s, watch=True, deadline=deadline)

    def _look_again(self) -> None:
        self._status_at = 0.0  # the replica may have changed: the next status read is fresh

    async def _refresh_status(self) -> dict[str, Any]:
        try:
            status = await self._call("describe", timeout_s=self._t.describe_timeout_s)
        except GangServeError as exc:
            status = await self.diagnose(f"gang server not answering ({exc.message})")
        self._adopt(status, pushed=False)
        return status

    def _adopt(self, status: dict[str, Any], pushed: bool) -> None:
        """`status` is the gang's status from now on (the link chooses its route from it)."""
        self._link.observe(GangStatus.model_validate(status))  # typed: a renamed field fails here, loudly
        if status.get("state") == "ready":
            self._last_ready = time.monotonic()
        self._status, self._status_at, self._status_pushed = status, time.monotonic(), pushed

    # -- the pushed fleet view -------------------------------------------------------------
    def _start_following(self) -> None:
        if self._fleet.connected and (self._follower is None or self._follower.done()):
            self._follower = asyncio.get_running_loop().create_task(self._follow_fleet())

    def _following(self) -> bool:
        """The long poll answered recently enough that the pushed view is current."""
        return time.monotonic() - self._pushed_at <= self._follow_fresh_s

    async def _follow_fleet(self) -> None:
        """Follow the Controller's fleet view (a long poll, Controller.watch_fleet): every
        change of a gang's state, generation, weights or placement arrives at once, and the
        request path reads it instead of asking the gang server. While the Controller cannot
        answer (it restarts), `status` asks the gang server itself, as it does when the view
        names no gang (none placed yet, or the one there was is lost)."""
        version = -1
        while True:
            try:
                view = await self._fleet.watch(version)
            except GangServeError as exc:
                log.info("not following the fleet view for %.0fs: %s", self._t.skip_after_failure_s, exc.message)
                self._pushed_at, self._status_pushed = 0.0, False
                await asyncio.sleep(self._t.skip_after_failure_s)
                continue
            except Exception:  # noqa: BLE001 - the follower must outlive any one failure
                log.exception("the fleet view's long poll failed")
                self._pushed_at, self._status_pushed = 0.0, False
                await asyncio.sleep(self._t.skip_after_failure_s)
                continue
            version, self._pushed_at = int(view.get("version", -1)), time.monotonic()
            status = self._gang_in(view["gangs"])
            if status is not None:
                self._adopt(status, pushed=True)
            else:
                self._status_pushed = False  # no gang to show: the gang server (or a diagnosis) says

    def _gang_in(self, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The status a request path acts on, from the fleet's rows: a ready gang if any (with
        several, Serve's router picks among the ready ones); with one gang, that gang in any
        state it reported; None when there is none to show. A row the Controller could not
        confirm (`unreachable`: no fresh report, or its pings fail) is not shown: the gang
        server's own answer decides then (it may well reach this ingress)."""
        ready = [row for row in rows if row.get("state") == "ready"]
        if ready:
            return ready[0]
        reported = [row for row in rows if row.get("state") != "unreachable"]
        return reported[0] if self._single_gang and reported else None

    def saw_ready(self) -> None:
        """A gang was seen serving (by the fleet view): the schedule timeout counts from now."""
        self._last_ready = time.monotonic()

    async def diagnose(self, what: str) -> dict[str, Any]:
        """A status for a gang that is not there (`what` says how we know), in
        needed-vs-available terms: unschedulable, past `schedule_timeout_s`, or scheduling."""
        snapshot = await self._snapshots.get()  # None: unknown (the GCS is slow), never a wait past its bound
        since = self._last_ready if self._last_ready is not None else self._created
        waited = time.monotonic() - since
        if snapshot is not None:
            try:
                check_feasible(snapshot, self._request)
            except GangUnschedulable as unschedulable:
                return dump(GangStatus(state="unschedulable", code=ErrorCode.UNSCHEDULABLE,
                                       reason=unschedulable.message))
        waiting = waiting_reason(snapshot, self._request, self._snapshots.why_none)
        if waited > self._cfg.schedule_timeout_s:
            return dump(GangStatus(
                state="unschedulable",
                code=ErrorCode.SCHEDULE_TIMEOUT,
                reason=f"gave up after {waited:.0f}s (schedule_timeout_s={self._cfg.schedule_timeout_s:g}): {waiting}",
            ))
        return dump(GangStatus(
            state="scheduling",
            code=ErrorCode.GANG_SCHEDULING,
            reason=f"{what}, {waited:.0f}s without a ready gang; {waiting}",
        ))

    async def session_call(self, method: str, *args: Any, session_id: str | None, deadline: float,
                           **kwargs: Any) -> Any:
        """GangServer.<method>(*args, session_id=..., timeout_s=<left>, **kwargs) by `deadline`
        (service.sessions): routed to the gang holding the session (service.gang.router),
        retried through the retryable gang failures (a failed step appended nothing) while
        the deadline allows."""
        attempt = 0
        if session_id is not None:
            kwargs["session_id"] = session_id
        await self._status_by(deadline, self._t.status_max_age_s)  # the link's route follows the gang's status
        while True:
            try:
                if method == "session_append" and session_id is not None:  # the hot path: the link's route
                    return await self._link.session_append(*args, session_id=session_id, deadline=deadline)
                return await self._call(method, *args, timeout_s=self._cfg.request_timeout_s, deadline=deadline,
                                        **kwargs)
            except GangServeError as error:
                if error.code not in RETRYABLE_CODES:
                    raise
                delay = self._t.retry_backoff_s[min(attempt, len(self._t.retry_backoff_s) - 1)]
                attempt += 1
                self.retries += 1
                process_metrics().inc("gangserve_request_retries", (error.code,))
                await _pause(delay, deadline, f"retrying a session call after {error.code}: {error.message}")

    async def _call(self, method: str, *args: Any, timeout_s: float, watch: bool = False,
                    deadline: float | None = None, **kwargs: Any) -> Any:
        """One handle call bounded by timeout_s, or by `deadline` (see _bounded), which it
        also carries to the gang server as `timeout_s=` (the seconds left); Ray's errors
        mapped. `kwargs` go to the method (a `session_id` also steers the request router)."""
        if deadline is None:
            response = getattr(self._handle, method).remote(*args, **kwargs)
        else:
            response = getattr(self._handle, method).remote(*args, timeout_s=seconds_left(deadline), **kwargs)
        try:
            return await self._bounded(awaited(response), method, timeout_s, watch, on_cancel=response.cancel,
                                       deadline=deadline)
        except Exception as exc:
            if isinstance(exc, GangServeError) and not isinstance(exc, RayTaskError):
                raise  # ours: the deadline, or the gang seen unable to answer
            error = map_handle_error(exc, what="gang server", method=method,
                                     passthrough=(shm.SharedMemoryUnavailable,))
            if error is None:
                raise
            if isinstance(exc, RayError) and not isinstance(exc, RayTaskError):
                self._status_at = 0.0  # the replica may be gone: force a fresh status next time
            raise error from None

    async def _bounded(self, call: Awaitable[T], what: str, timeout_s: float, watch: bool = False,
                       on_cancel: Callable[[], object] | None = None, deadline: float | None = None) -> T:
        """Await `call` for at most timeout_s (504 gang_timeout), or until the request's
        `deadline` (monotonic; 504 deadline_exceeded) when given. With `watch`, also give up
        (503) as soon as the gang server is seen unable to answer, so a request never sits
        behind a gang that is not there. Giving up (or being cancelled) cancels the call."""
        task = asyncio.ensure_future(call)
        request_deadline = deadline
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if request_deadline is not None:
                        raise DeadlineExceeded(f"the request's deadline passed while the gang computed {what}")
                    raise CollectiveTimeout(
                        f"the gang did not answer {what} within {timeout_s:.1f}s", code=ErrorCode.GANG_TIMEOUT
                    )
                done, _ = await asyncio.wait({task}, timeout=min(remaining, self._t.status_max_age_s if watch else remaining))
                if done:
                    return task.result()
                if watch:
                    status = await self._status_by(deadline, self._t.status_max_age_s)
                    if status is None:
                        continue  # the deadline passed meanwhile: the loop's top says so
                    # With several gangs the call is on a placed gang the router chose: a
                    # "scheduling" status (one gang server's describe failed, a new gang
                    # waits for its bundles) says nothing about it; only "unschedulable" is app-wide.
                    if status["state"] == "unschedulable" or (self._single_gang and status["state"] == "scheduling"):
                        raise unavailable_error(status)
        finally:
            if not task.done():
                task.cancel()
                if on_cancel is not None:
                    on_cancel()



def unavailable_error(status: dict[str, Any]) -> GangServeError:
    state, reason = status["state"], status.get("reason", "")
    code = status.get("code") or gang_state_code(state)
    if state == "unschedulable":
        return GangUnschedulable(reason, code=code)
    return GangUnavailable(f"gang is {state}: {reason}", code=code)



def _count_drop(reason: str) -> None:
    """A request the ingress dropped before sending it (`deadline`, or `disconnected`: its
    client went away while it waited for a gang), for /metrics."""
    process_metrics().inc("gangserve_requests_dropped", ("ingress", reason))


async def _pause(delay: float, deadline: float, doing: str) -> None:
    """Sleep `delay`, or until `deadline` and then raise 504 deadline_exceeded (saying what
    the request was doing)."""
    left = deadline - time.monotonic()
    if left <= delay:
        await asyncio.sleep(max(0.0, left))
        _count_drop("deadline")
        raise DeadlineExceeded(f"the request's deadline passed while {doing}")
    await asyncio.sleep(delay)
