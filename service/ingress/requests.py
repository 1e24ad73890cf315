"""The ingress's request policy: a request's deadline, its retries and its choice of gang.

Who does what on the way from a route to rank 0:
- `RequestPolicy` (here) owns a request from the route's call to its answer: its deadline,
  whether it waits for a gang, when it is retried and when it gives up. It reads the gang's
  status from three sources, best first: the Controller's pushed fleet view
  (service.ingress.fleet_client.FleetClient.pushed_gang), the gang server's own `describe`,
  and, when no gang server answers, a diagnosis from the cluster's resources
  (service.ingress.diagnosis);
- `GangServerCalls` (here) makes every call to the GangServer replica: bounded, its deadline
  carried as `timeout_s=` (the seconds left), Ray's errors mapped (service.ingress.handle_errors);
- the link (service.transport.link.GangLink) owns the route to rank 0: the data channel,
  shared memory, or a handle call by value.

Deadlines and in-service retry (issue 23). Every request carries a deadline
(service.contract.deadlines) over the hop and into the gang's batcher. A request that fails because
its gang broke (RETRYABLE_CODES: a rank died, a collective timed out, the gang is rebuilding
or stopping, its replica is gone or restarting; never bad input, never the deadline) is sent
again, inferences and session calls alike: at once (with several gangs Serve's router picks a ready one), or, with one gang, once it is
ready again. An inference that arrives while no gang can serve waits for one instead of
getting 503 at once, at most `max_queued_requests` of them at a time. Waiting and retrying
end at the request's deadline: 504 `deadline_exceeded` then. 503 + Retry-After only when
the gang is unschedulable, or when the expected wait (the length of the last outage this
ingress saw, ingress.default_outage_s before any) would end after the deadline: the message
says both. Inference is idempotent and every step runs on one weights version across ranks
(service.gang), so a retried answer is as right as a first one. A session append is not
idempotent by itself: a retryable failure may come after the gang server committed it (the
answer lost on the way back). What makes its retry safe is its idempotency key
(service.sessions.keys): the
retry carries the same key, and the session answers a committed append's kept answer
instead of appending again (service.sessions.registry). So a call that appends
(`KEYED_METHODS`) never leaves here without a key: the client's, else one made here
(`session_call`) before the first try and its route are chosen, and reused by every try.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import numpy as np
import ray
from ray.exceptions import RayError, RayTaskError
from ray.serve.handle import DeploymentHandle

from service.config.builder_args import AppConfig
from service.contract.deadlines import bounded, seconds_left
from service.contract.errors import (RETRYABLE_CODES, CollectiveTimeout, DeadlineExceeded, DeadlineExceededBeforeStep,
                            ErrorCode, GangServeError, GangUnavailable, gang_state_code)
from service.cluster.placement import GangUnschedulable
from service.contract.gang_status import AnyGangStatus, GangStatus
from service.ingress.fleet_client import FleetClient
from service.ingress.handle_errors import awaited, map_handle_error
from service.metrics.process import process_metrics
from service.sessions.keys import new_key
from service.transport import shm
from service.transport.link import GangLink

log = logging.getLogger("gangserve.ingress")
T = TypeVar("T")
# Session calls that append rows: retried only with an idempotency key (see the module docstring).
KEYED_METHODS = frozenset({"session_append", "session_oip"})


class GangServerCalls:
    """Every call from this ingress replica to a GangServer replica (Serve's router picks
    which; a `session_id` keyword steers it): bounded, failures mapped to GangServeErrors."""

    def __init__(self, handle: DeploymentHandle, config: AppConfig) -> None:
        self._handle = handle
        self._request_timeout_s = config.serving.request_timeout_s
        self.replica_lost_at = 0.0  # time.monotonic() of the last failure that was not the gang's own answer

    async def request(self, method: str, *args: Any, deadline: float, **kwargs: Any) -> Any:
        """GangServer.<method>(*args, timeout_s=<seconds left>, **kwargs) by `deadline`
        (504 deadline_exceeded after)."""
        return await self.call(method, *args, deadline=deadline, **kwargs)

    async def call(self, method: str, *args: Any, timeout_s: float | None = None, deadline: float | None = None,
                   **kwargs: Any) -> Any:
        """One handle call by `deadline` (monotonic; carried to the method as `timeout_s=`, the
        seconds left) or within `timeout_s` (504 gang_timeout after)."""
        if deadline is None:
            limit_s = self._request_timeout_s if timeout_s is None else timeout_s
            response = getattr(self._handle, method).remote(*args, **kwargs)
            until = time.monotonic() + limit_s
            timed_out: Callable[[], BaseException] = lambda: CollectiveTimeout(
                f"the gang did not answer {method} within {limit_s:.1f}s", code=ErrorCode.GANG_TIMEOUT)
        else:
            response = getattr(self._handle, method).remote(*args, timeout_s=seconds_left(deadline), **kwargs)
            until = deadline
            timed_out = lambda: DeadlineExceeded(f"the request's deadline passed while the gang computed {method}")
        try:
            return await bounded(awaited(response), until=until, timed_out=timed_out, on_cancel=response.cancel)
        except Exception as exc:
            if isinstance(exc, GangServeError) and not isinstance(exc, RayTaskError):
                raise  # ours: the bound
            error = map_handle_error(exc, what="gang server", method=method,
                                     passthrough=(shm.SharedMemoryUnavailable,))
            if error is None:
                raise
            if isinstance(exc, RayError) and not isinstance(exc, RayTaskError):
                self.replica_lost_at = time.monotonic()  # the replica may be gone: look at the gang again
            raise error from None


class RequestPolicy:
    """A request's deadline, retries and choice of gang (see the module docstring); what the
    routes call (service.ingress.deps.Gang)."""

    def __init__(self, calls: GangServerCalls, link: GangLink, fleet: FleetClient, config: AppConfig) -> None:
        self._calls = calls
        self._link = link
        self._fleet = fleet
        self._diagnosis = fleet.diagnosis
        self._cfg = config
        self._single_gang = config.gang.single_gang
        self._t = config.tunables.ingress  # status age, describe bound, retry backoff, waits
        self._status: AnyGangStatus | None = None
        self._status_at = 0.0
        self._stale_since = 0.0  # statuses from before this are not acted on (a failure, a swap)
        self._refresh: asyncio.Task | None = None
        self._waiting = 0  # requests waiting for a gang to serve (bounded by max_queued_requests)
        self._outage_since: float | None = None  # first failure of the current outage
        self._last_outage_s: float | None = None  # how long the last one lasted
        self.retries = 0  # requests this policy retried (tests read it; the metric counts them too)
        for reason in ("deadline", "disconnected"):
            process_metrics().inc("gangserve_requests_dropped", ("ingress", reason), 0.0)

    # -- the routes' calls -----------------------------------------------------------------
    async def infer(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    deadline: float | None = None) -> np.ndarray:
        """x [batch, seq, E] float32, key mask [batch, seq] bool (None: all tokens), causal
        (None: the served model's default) -> [batch, seq, E] float32, by `deadline`
        (time.monotonic(); None: `request_timeout_s` from now)."""
        if deadline is None:
            deadline = time.monotonic() + self._cfg.serving.request_timeout_s
        request_deadline = deadline

        async def send() -> np.ndarray:
            if time.monotonic() >= request_deadline:
                _count_drop("deadline")
                raise DeadlineExceededBeforeStep("the request's deadline passed before it could be sent to the "
                                                 "gang; it was not computed")
            return await self._watched(self._link.infer(x, mask, causal, request_deadline), request_deadline)

        return await self._with_retries(send, deadline, wait_for_gang=True)

    async def session_call(self, method: str, *args: Any, session_id: str | None, deadline: float,
                           idempotency_key: str | None = None, **kwargs: Any) -> Any:
        """GangServer.<method>(*args, session_id=..., timeout_s=<left>, **kwargs) by `deadline`
        (service.sessions), routed to the gang holding the session (service.gang.router);
        an append takes the link's route (the data channel when it is the route).
        `idempotency_key`: the client's key for a call of KEYED_METHODS (validated by the
        route, service.sessions.keys); None: one is made here, before the first try. Every
        try (the link's fallback, the retries below) sends that one key: what makes retrying
        an append safe."""
        if session_id is not None:
            kwargs["session_id"] = session_id
        if method in KEYED_METHODS and idempotency_key is None:
            idempotency_key = new_key()
        if idempotency_key is not None:
            kwargs["idempotency_key"] = idempotency_key

        async def send() -> Any:
            if method == "session_append" and session_id is not None and idempotency_key is not None:
                # the hot path: the link's route (the key makes its fallback safe)
                return await self._link.session_append(*args, session_id=session_id,
                                                       idempotency_key=idempotency_key, deadline=deadline)
            return await self._calls.request(method, *args, deadline=deadline, **kwargs)

        return await self._with_retries(send, deadline, wait_for_gang=False)

    async def reload_weights(self, checkpoint: str | None, job_id: str | None = None,
                             eval_loss: float | None = None) -> GangStatus:
        """Hot-swap the gang to a dense checkpoint (None: back to the app's configured
        weights), recorded as the app's next weights version (with the job's final
        `eval_loss`, if any); returns the gang's new report. Bounded by ingress.swap_timeout_s."""
        self._look_again()  # the version changes
        return await self._calls.call("reload_weights", checkpoint, job_id, eval_loss, timeout_s=self._t.swap_timeout_s)

    async def rollback_weights(self, version: int) -> GangStatus:
        """Serve recorded weights `version` again (GangServer.rollback_weights), recorded as
        the app's next version; returns the gang's new report. Bounded by ingress.swap_timeout_s."""
        self._look_again()
        return await self._calls.call("rollback_weights", version, timeout_s=self._t.swap_timeout_s)

    async def describe(self) -> AnyGangStatus:
        """GET /gang: the gang server's own report, fresh (or why none answers), with how this
        ingress replica has been handing tensors to the gang."""
        status = await self.status(max_age_s=0.0)
        return status.model_copy(update={"ingress_transport": self._link.transport()})

    # -- the gang's status -----------------------------------------------------------------
    async def status(self, max_age_s: float) -> AnyGangStatus:
        """The gang's status, at most `max_age_s` old: the Controller's pushed view while it is
        current and names a gang, else the gang server's own `describe` (refreshed in the
        background when stale), or a diagnosis when no gang server answers. `max_age_s <= 0`:
        always the gang server's own, fresh."""
        self._fleet.follow()
        # A route, the replica or a request failed since: only a status from after it counts.
        stale_since = max(self._stale_since, self._calls.replica_lost_at, self._link.route_lost_at)
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
        if age > 5 * max_age_s + self._t.describe_timeout_s:  # far too stale to trust: wait for fresh
            return await self._refresh_status()
        return self._status

    async def _refresh_status(self) -> AnyGangStatus:
        status: AnyGangStatus
        try:
            status = await self._calls.call("describe", timeout_s=self._t.describe_timeout_s)
        except GangServeError as exc:
            status = await self._diagnosis.diagnose(f"gang server not answering ({exc.message})")
        self._adopt(status)
        self._status_at = time.monotonic()
        return status

    def _look_again(self) -> None:
        """The next status read is fresh (pushed after now, or the gang server's own)."""
        self._stale_since = time.monotonic()

    def _adopt(self, status: AnyGangStatus) -> None:
        """`status` is the gang's status from now on (the link chooses its route from it)."""
        self._link.observe(status)
        if status.state == "ready":
            self._diagnosis.saw_ready()
        self._status = status

    async def _status_by(self, deadline: float, max_age_s: float) -> AnyGangStatus | None:
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

    # -- retries and waits -----------------------------------------------------------------
    async def _with_retries(self, send: Callable[[], Awaitable[T]], deadline: float, wait_for_gang: bool) -> T:
        """`send()` until it answers, retried through the retryable gang failures while the
        deadline allows. `wait_for_gang`: look at the gang's status before each try and wait
        (one poll at a time) while the app-wide conditions say no gang can serve."""
        attempt = 0
        while True:
            # A gang seen not ready is looked at again sooner: a rebuild takes about a second,
            # and a 1 s old "broken" would hold requests for as long again after it.
            ready = self._status is not None and self._status.state == "ready"
            status = await self._status_by(
                deadline, self._t.wait_poll_s if attempt or not ready else self._t.status_max_age_s)
            if status is None:
                _count_drop("deadline")
                raise DeadlineExceededBeforeStep("the request's deadline passed while the ingress read the gang's "
                                                 "status; it was not computed")
            # The status is one gang's. With several gangs, one broken or rebuilding gang says
            # nothing about the others (the router sends to ready ones; a broken one answers 503
            # at once), so only app-wide conditions wait here.
            if wait_for_gang and status.state != "ready" and (
                    self._single_gang or status.state in ("scheduling", "unschedulable")):
                await self._wait_for_gang(status, deadline)
                continue
            try:
                out = await send()
            except GangServeError as exc:
                if exc.code not in RETRYABLE_CODES:
                    raise
                self._saw_outage()
                self._look_again()  # before the next try
                if self._single_gang and wait_for_gang:
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

    async def _watched(self, call: Awaitable[T], deadline: float) -> T:
        """`call` (the link's), abandoned (503) as soon as the gang is seen unable to answer,
        so a request never sits behind a gang that is not there."""
        async def give_up_if_absent() -> None:
            status = await self._status_by(deadline, self._t.status_max_age_s)
            # With several gangs the call is on a placed gang the router chose: a "scheduling"
            # status (one gang server's describe failed, a new gang waits for its bundles) says
            # nothing about it; only "unschedulable" is app-wide.
            if status is not None and (status.state == "unschedulable"
                                       or (self._single_gang and status.state == "scheduling")):
                raise unavailable_error(status)

        return await bounded(call, until=deadline, check=give_up_if_absent, check_every_s=self._t.status_max_age_s,
                             timed_out=lambda: DeadlineExceeded("the request's deadline passed while the gang computed it"))

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

    async def _wait_for_gang(self, status: AnyGangStatus, deadline: float) -> None:
        """Wait one poll for a gang to serve again (the caller looks at the status again).
        503 when the gang can never be placed, when the wait would outlast the deadline
        (`_check_wait`) or when `max_queued_requests` requests wait already; 504
        `deadline_exceeded` when the deadline passes meanwhile."""
        if status.state == "unschedulable":
            raise unavailable_error(status)
        self._saw_outage()
        why = f"gang is {status.state}: {status.reason}"
        self._check_wait(why, deadline)
        limit = self._cfg.serving.max_queued_requests
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


def connect(handle: DeploymentHandle, config: AppConfig, fleet: FleetClient | None = None,
            node_id: str | None = None) -> RequestPolicy:
    """The ingress's request policy over a GangServer handle: its calls, its link (`node_id`:
    the Ray node this replica runs on, default this process's; the link looks for rank 0
    there) and the fleet view (default: none, the gang server's own status only)."""
    fleet = fleet or FleetClient(None, config)
    calls = GangServerCalls(handle, config)
    shm_enabled = config.transport.shm_transport and shm.available()
    link = GangLink(node_id=node_id or ray.get_runtime_context().get_node_id(),
                    channel_enabled=config.uses_data_channel, shm_enabled=shm_enabled, calls=calls,
                    tunables=config.tunables.transport)
    if shm_enabled:
        shm.sweep_stale()  # files a crashed ingress on this node left behind
    return RequestPolicy(calls, link, fleet, config)


def unavailable_error(status: AnyGangStatus, reason: str | None = None) -> GangServeError:
    """The 503 a request gets from a gang in `status` (`reason`: its reason as shown, e.g.
    with paths redacted)."""
    reason = status.reason if reason is None else reason
    code = status.code or gang_state_code(status.state)
    if status.state == "unschedulable":
        return GangUnschedulable(reason, code=code)
    return GangUnavailable(f"gang is {status.state}: {reason}", code=code)


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
