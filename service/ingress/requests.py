"""The ingress's request policy: a request's deadline, its retries and its choice of gang,
composed of small parts, each the one owner of its job:
- `GangServerCalls` (service.ingress.gang_calls): every call to a GangServer replica,
  bounded, Ray's errors mapped;
- the link (service.transport.link.GangLink): the route to rank 0 (the data channel,
  shared memory, or a handle call by value);
- `GangStatusView` (service.ingress.status_view): the gang's state and its freshness;
- `Retrier` and `RETRY_TABLE` (service.ingress.retries): which call is sent again after
  which code, and which only with an idempotency key;
- `Admission` (service.ingress.admission): which requests wait for a gang, how many;
- `OutageEstimate` (service.ingress.outages): when the gang is expected back;
- `WeightsAdmin` (service.ingress.weights_admin): the weights swaps, off the request path.

Deadlines (service.contract.deadlines): every request carries one over the hop and into the
gang's batcher. Waiting and retrying end at it: 504 `deadline_exceeded` then. 503 +
Retry-After only when the gang is unschedulable, or when the expected wait would end after
the deadline: the message says both.
"""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, TypeVar

import numpy as np
import ray
from ray.serve.handle import DeploymentHandle

from service.config.builder_args import AppConfig
from service.contract.deadlines import bounded
from service.contract.errors import DeadlineExceeded, DeadlineExceededBeforeStep, GangServeError
from service.contract.gang_status import AbsentState, GangAnswer, GangStatus, IngressGangStatus, SynthesizedStatus
from service.ingress.admission import Admission
from service.ingress.fleet_client import FleetClient
from service.ingress.gang_calls import GangServerCalls
from service.ingress.outages import OutageEstimate
from service.ingress.retries import RETRY_TABLE, GangMethod, Retrier
from service.ingress.status_view import GangStatusView, unavailable_error
from service.ingress.waits import DropReason, count_drop, declare_drops
from service.ingress.weights_admin import WeightsAdmin
from service.sessions.keys import new_key
from service.transport import shm
from service.transport.link import GangLink

T = TypeVar("T")


class RequestPolicy:
    """What the routes call (service.ingress.deps.Gang): a request's way to the gang."""

    def __init__(self, calls: GangServerCalls, link: GangLink, fleet: FleetClient, config: AppConfig) -> None:
        t = config.tunables.ingress  # status age, describe bound, retry backoff, waits
        self._calls = calls
        self._link = link
        self._t = t
        self._request_timeout_s = config.serving.request_timeout_s
        self._single_gang = config.gang.single_gang
        self.status = GangStatusView(self._describe, fleet, link, lambda: calls.replica_lost_at,
                                     single_gang=self._single_gang, describe_timeout_s=t.describe_timeout_s)
        self._outages = OutageEstimate(t.default_outage_s)
        self._admission = Admission(self._outages, single_gang=self._single_gang,
                                    max_queued_requests=config.serving.max_queued_requests, poll_s=t.wait_poll_s)
        self._retrier = Retrier(t.retry_backoff_s)
        self.weights = WeightsAdmin(calls, self.status, t.swap_timeout_s)
        declare_drops()

    @property
    def retries(self) -> int:
        """Tries this policy sent again (tests read it; the metric counts them too)."""
        return self._retrier.retries

    # -- the routes' calls -----------------------------------------------------------------
    async def infer(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    deadline: float | None = None) -> np.ndarray:
        """x [batch, seq, E] float32, key mask [batch, seq] bool (None: all tokens), causal
        (None: the served model's default) -> [batch, seq, E] float32, by `deadline`
        (time.monotonic(); None: `request_timeout_s` from now). Waits for a gang while none
        can serve (service.ingress.admission)."""
        by = time.monotonic() + self._request_timeout_s if deadline is None else deadline

        async def send() -> np.ndarray:
            if time.monotonic() >= by:
                count_drop(DropReason.DEADLINE)
                raise DeadlineExceededBeforeStep("the request's deadline passed before it could be sent to the "
                                                 "gang; it was not computed")
            return await self._watched(self._link.infer(x, mask, causal, by), by)

        return await self._with_retries(GangMethod.INFER, send, by, wait_for_gang=True, has_key=False)

    async def session_call(self, method: GangMethod, *args: Any, session_id: str | None, deadline: float,
                           idempotency_key: str | None = None, **kwargs: Any) -> Any:
        """GangServer.<method>(*args, session_id=..., timeout_s=<left>, **kwargs) by `deadline`
        (service.sessions), routed to the gang holding the session (service.gang.router);
        an append takes the link's route (the data channel when it is the route).
        `idempotency_key`: the client's key for a call whose retry rule needs one
        (service.ingress.retries; validated by the route, service.sessions.keys); None: one
        is made here, before the first try. Every try (the link's fallback, the retries)
        sends that one key: what makes retrying an append safe."""
        method = GangMethod(method)
        if session_id is not None:
            kwargs["session_id"] = session_id
        if RETRY_TABLE[method].needs_key and idempotency_key is None:
            idempotency_key = new_key()
        if idempotency_key is not None:
            kwargs["idempotency_key"] = idempotency_key

        async def send() -> Any:
            if method is GangMethod.SESSION_APPEND and session_id is not None and idempotency_key is not None:
                # the hot path: the link's route (the key makes its fallback safe)
                return await self._link.session_append(*args, session_id=session_id,
                                                       idempotency_key=idempotency_key, deadline=deadline)
            return await self._calls.call(method.value, *args, deadline=deadline, **kwargs)

        # One gang: the session's, so a call waits while it is not ready (as an inference
        # does) instead of being sent again at every backoff step to a gang that refuses it.
        # Several: the status read is one gang's, maybe not the session's; the retries decide.
        return await self._with_retries(method, send, deadline, wait_for_gang=self._single_gang,
                                        has_key=idempotency_key is not None)

    async def describe(self) -> GangAnswer:
        """GET /gang: the gang server's own report, fresh (or why none answers), with how this
        ingress replica has been handing tensors to the gang."""
        status = await self.status.read(max_age_s=0.0)
        transport = self._link.transport()
        if isinstance(status, SynthesizedStatus):
            return SynthesizedStatus(state=status.state, code=status.code, reason=status.reason,
                                     ingress_transport=transport)
        return IngressGangStatus.of(status, transport)  # a fresh read is the gang server's own report

    # -- the parts together ----------------------------------------------------------------
    async def _describe(self) -> GangStatus:
        """The gang server's own report (GangServer.describe), bounded by ingress.describe_timeout_s."""
        return await self._calls.call("describe", timeout_s=self._t.describe_timeout_s)

    async def _with_retries(self, method: GangMethod, send: Callable[[], Awaitable[T]], deadline: float, *,
                            wait_for_gang: bool, has_key: bool) -> T:
        """`send()` by `deadline`, tried again as `method`'s retry rule says. Before each try
        the gang's status is read (a gang seen not ready, or a retry, looks at a fresher one:
        a rebuild takes about a second, and a 1 s old "broken" would hold requests for as long
        again after it); `wait_for_gang`: the request waits while admission says so."""
        async def try_once(attempt: int) -> T:
            while True:
                fresh = attempt or not self.status.seen_ready
                status = await self.status.read_by(deadline, self._t.wait_poll_s if fresh else self._t.status_max_age_s)
                if status is None:
                    count_drop(DropReason.DEADLINE)
                    raise DeadlineExceededBeforeStep("the request's deadline passed while the ingress read the "
                                                     "gang's status; it was not computed")
                if not (wait_for_gang and self._admission.must_wait(status)):
                    break
                await self._admission.wait(status, deadline)
            out = await send()
            self._outages.served()
            return out

        def before_retry(exc: GangServeError) -> None:
            self._outages.saw_failure()
            self.status.look_again()
            if self._single_gang and wait_for_gang:
                self._outages.check(exc.message, deadline)

        return await self._retrier.run(method, try_once, deadline, has_key=has_key, before_retry=before_retry)

    async def _watched(self, call: Awaitable[T], deadline: float) -> T:
        """`call` (the link's), abandoned (503) as soon as the gang is seen unable to answer,
        so a request never sits behind a gang that is not there."""
        async def give_up_if_absent() -> None:
            status = await self.status.read_by(deadline, self._t.status_max_age_s)
            # With several gangs the call is on a placed gang the router chose: a "scheduling"
            # status (one gang server's describe failed, a new gang waits for its bundles) says
            # nothing about it; only "unschedulable" is app-wide.
            if status is not None and (status.state is AbsentState.UNSCHEDULABLE
                                       or (self._single_gang and status.state is AbsentState.SCHEDULING)):
                raise unavailable_error(status)

        return await bounded(call, until=deadline, check=give_up_if_absent, check_every_s=self._t.status_max_age_s,
                             timed_out=lambda: DeadlineExceeded("the request's deadline passed while the gang computed it"))


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
