"""How a request reaches rank 0 of the gang: the one owner of the ingress -> gang hop.

A request tensor x [batch, seq, E] float32 (with its key mask, causal flag and deadline)
takes one of three routes, best first:

- **data channel** (service.transport.channel): the GangServer replica's Unix socket, when
  the app has one gang (`uses_data_channel`), that gang is ready, its rank 0 runs on this
  ingress replica's node and the socket listens. Tensors of `transport.min_shared_bytes` or more
  cross through the connection's shared region in /dev/shm;
- **handle call through shared memory** (service.transport.shm): a Serve handle call that
  carries only a reference to pages in /dev/shm, when rank 0 shares this node (several gangs:
  Serve's router picks the gang) and the tensor is big enough;
- **handle call by value**: everything else (rank 0 on another node, no /dev/shm).

The route is chosen when the link sees a new gang status (`observe`: a new replica, a new
generation, a change of state), not per request; per request only the tensor's size and
the fallback clocks count. A failed channel sends requests through the handle for
`channel_retry_after_s` (the gang's status is then read again: the replica may have
changed); a failed shared-memory hand-off sends tensors by value for `shm_retry_after_s`.
The counters of each route (GET /gang `ingress_transport`) live here too.

Every wait is bounded by the request's deadline: handle calls through `GangCalls` (which
carries the deadline to the gang server and maps Ray's errors), the channel's through
service.contract.deadlines.bounded, the one bounded wait. The link takes no decision about the
gang (whether to wait for it, retry, or give up when it is seen unable to answer): that is
the request policy's (service.ingress.requests), which calls the link and reads
`route_lost_at` to look at the gang's status again after a route failed.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, NamedTuple, Protocol, TypeVar

import numpy as np

from service.contract.deadlines import bounded, seconds_left
from service.contract.errors import DeadlineExceeded, ErrorCode, GangUnavailable
from service.contract.gang_status import AnyGangStatus, IngressTransport, SynthesizedStatus
from service.metrics.process import process_metrics
from service.transport import shm
from service.transport.channel import ChannelClient, ChannelUnavailable, socket_path
from service.config.tunables import TransportTunables

log = logging.getLogger("gangserve.ingress")
T = TypeVar("T")


class GangCalls(Protocol):
    """Calls to the GangServer replica by a request's `deadline` (time.monotonic(); carried to
    the gang server as the seconds left), failures mapped to GangServeErrors; keyword
    arguments go to the method (a `session_id` also steers the request router)."""

    async def call(self, method: str, *args: Any, deadline: float, **kwargs: Any) -> Any: ...


@dataclass
class _Counters:
    data_channel: int = 0  # requests sent over the channel
    data_channel_fallbacks: int = 0  # channel failures (the request then took the handle)
    shared_memory: int = 0  # requests whose tensor crossed through /dev/shm (either route)
    shared_memory_fallbacks: int = 0
    object_store: int = 0  # handle calls by value


class _Seen(NamedTuple):
    """What a route was last chosen from (`GangLink.observe`)."""

    replica: str | None
    generation: int | None
    state: str
    fleet_rank0_nodes: frozenset[str] | None


class GangLink:
    """The route from this ingress replica to the gang's rank 0 (see the module docstring)."""

    def __init__(self, *, node_id: str, channel_enabled: bool, shm_enabled: bool, calls: GangCalls,
                 tunables: TransportTunables = TransportTunables()) -> None:
        self._t = tunables  # share threshold, retry-after times, the channel's bounds
        self._node_id = node_id
        self._channel_enabled = channel_enabled
        self._shm_enabled = shm_enabled
        self._calls = calls
        self._seen: _Seen | None = None  # the last status observed
        self._channel: ChannelClient | None = None  # the current gang's socket, when the channel is the route
        self._channel_replica: str | None = None
        self._every_rank0_here = False  # rank 0 of every gang a handle call may reach is on this node
        self._channel_retry_at = 0.0
        self._shm_retry_at = 0.0
        self.route_lost_at = 0.0  # time.monotonic() of the last channel failure (the replica may have changed)
        self._counts = _Counters()

    def observe(self, status: AnyGangStatus, fleet_rank0_nodes: frozenset[str] | None) -> None:
        """A fresh status of the gang: choose the route again if its replica, generation or
        state changed (no gang server answering: handle calls, by value), or where the fleet
        view has the rank 0 of the app's gangs (`fleet_rank0_nodes`: empty with one gang, None
        when several and no current view). Shared memory through a handle call needs every one
        of them on this node: with several gangs Serve's router picks the gang, and a gang on
        another node cannot map this node's pages."""
        if isinstance(status, SynthesizedStatus):
            key = _Seen(None, None, status.state, fleet_rank0_nodes)
            ranks, listening, replica = [], False, None
        else:
            key = _Seen(status.replica_id, status.generation, status.state, fleet_rank0_nodes)
            ranks, listening, replica = status.ranks, status.data_channel.listening, status.replica_id
        if key == self._seen:
            return
        self._seen = key
        rank0_here = bool(ranks) and ranks[0].node_id == self._node_id
        self._every_rank0_here = rank0_here and fleet_rank0_nodes is not None and fleet_rank0_nodes <= {self._node_id}
        use_channel = (self._channel_enabled and status.state == "ready" and replica is not None
                       and rank0_here and listening)
        if not use_channel or replica is None:
            self._drop_channel()
        elif replica != self._channel_replica:  # a new gang server: its socket, a fresh start
            self._drop_channel()
            self._channel, self._channel_replica = ChannelClient(socket_path(replica), self._t), replica
            self._channel_retry_at = 0.0

    async def infer(self, x: np.ndarray, mask: np.ndarray | None, causal: bool | None,
                    deadline: float) -> np.ndarray:
        """x [batch, seq, E] float32 to rank 0 and its output back, by the current route (the
        mask, causal flag and deadline travel on every route)."""
        share = self._can_share(x)
        if self._channel is not None and time.monotonic() >= self._channel_retry_at:
            try:
                return await self._over_channel(self._channel, x, share, mask, causal, deadline)
            except ChannelUnavailable as exc:
                self._channel_failed(exc)
        if share:
            try:
                return await self._through_shared_memory(x, mask, causal, deadline)
            except shm.SharedMemoryUnavailable as exc:
                self._shm_failed(exc)
        self._counts.object_store += 1
        return await self._calls.call("infer", x, mask, causal, deadline=deadline)

    async def session_append(self, x: np.ndarray, length: int | None, *, session_id: str, idempotency_key: str,
                             deadline: float) -> tuple[np.ndarray, dict[str, Any]]:
        """Rows x [n, E] float32 appended to session `session_id` (service.sessions) ->
        (their outputs, the session's state): over the data channel when it is the route
        (one gang: the session's), else a handle call the request router sends to the gang
        the session id names.

        A failed channel says nothing about whether the gang server appended: the connection
        may close, or the reply arrive malformed, after it committed the append. The handle
        call that follows is safe because it carries the same `idempotency_key`
        (service.sessions.keys): a committed append answers its kept answer, one still in
        flight is waited for, and nothing is appended twice."""
        if self._channel is not None and time.monotonic() >= self._channel_retry_at:
            self._counts.data_channel += 1
            try:
                return await _by(deadline, self._channel.session_append(
                    x, session_id, length, timeout_s=seconds_left(deadline), idempotency_key=idempotency_key),
                    "a session append (data channel)")
            except ChannelUnavailable as exc:  # appended or not: the same key makes the handle call safe
                self._channel_failed(exc)
        self._counts.object_store += 1
        return await self._calls.call("session_append", x, length, deadline=deadline, session_id=session_id,
                                         idempotency_key=idempotency_key)

    def transport(self) -> IngressTransport:
        """GET /gang `ingress_transport`: how this ingress replica has been sending requests."""
        return IngressTransport(node_id=self._node_id, shm_enabled=self._shm_enabled,
                                data_channel_enabled=self._channel_enabled, **vars(self._counts))

    def close(self) -> None:
        self._drop_channel()

    # -- the routes ------------------------------------------------------------------------
    async def _over_channel(self, channel: ChannelClient, x: np.ndarray, share: bool, mask: np.ndarray | None,
                            causal: bool | None, deadline: float) -> np.ndarray:
        """Inline, or (tensors worth it) through the connection's shared region; the mask inline."""
        self._counts.data_channel += 1
        what = "an inference (data channel)"
        if share:
            try:
                out = await _by(deadline, channel.infer(x, share=True, mask=mask, causal=causal,
                                                        timeout_s=seconds_left(deadline)), what)
                self._counts.shared_memory += 1
                return out
            except shm.SharedMemoryUnavailable as exc:
                self._shm_failed(exc)  # /dev/shm full or unmappable: send the tensor itself
        return await _by(deadline, channel.infer(x, mask=mask, causal=causal, timeout_s=seconds_left(deadline)), what)

    async def _through_shared_memory(self, x: np.ndarray, mask: np.ndarray | None, causal: bool | None,
                                     deadline: float) -> np.ndarray:
        """A handle call carrying a reference to x's pages; rank 0 writes the output into them."""
        ref, view = shm.create(x, self._node_id)
        self._counts.shared_memory += 1
        try:  # the mask is small: by value
            shape = await self._calls.call("infer_shared", ref, mask, causal, deadline=deadline)
        finally:
            shm.unlink(ref)  # the pages stay mapped for `view` (and the gang, if still busy)
        if tuple(shape) != ref.shape:
            raise GangUnavailable(f"gang replied with shape {tuple(shape)} to a {ref.shape} request",
                                  code=ErrorCode.GANG_ERROR)
        return view  # [batch, seq, E] float32, written by the gang

    def _can_share(self, x: np.ndarray) -> bool:
        """Shared memory pays only for tensors Ray would not inline, and needs rank 0 on this node
        (of every gang a handle call may reach: `observe`)."""
        return (self._shm_enabled and self._every_rank0_here and x.size * 4 >= self._t.min_shared_bytes
                and time.monotonic() >= self._shm_retry_at)

    def _channel_failed(self, exc: Exception) -> None:
        self._counts.data_channel_fallbacks += 1
        self.route_lost_at = time.monotonic()
        self._channel_retry_at = self.route_lost_at + self._t.channel_retry_after_s
        log.warning("data channel failed (%s); using the Serve handle for %.0fs", exc,
                    self._t.channel_retry_after_s)

    def _shm_failed(self, exc: Exception) -> None:
        self._counts.shared_memory_fallbacks += 1
        process_metrics().inc("gangserve_shm_fallbacks")
        self._shm_retry_at = time.monotonic() + self._t.shm_retry_after_s
        log.warning("shared-memory hand-off failed (%s); sending tensors by value for %.0fs", exc,
                    self._t.shm_retry_after_s)

    def _drop_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel, self._channel_replica = None, None


async def _by(deadline: float, call: Awaitable[T], what: str) -> T:
    """`call` (a data channel exchange) by the request's deadline: 504 deadline_exceeded after."""
    return await bounded(call, until=deadline, timed_out=lambda: DeadlineExceeded(
        f"the request's deadline passed while the gang computed {what}"))
