"""GangServer: the Serve deployment that owns the gang. It never parses HTTP.

One replica = one gang. Serve reserves the replica's placement group
(`placement_group_bundles`, one bundle per rank) before the replica starts; the replica
itself is rank 0 in bundle 0 and places ranks 1..N-1 in the other bundles.

Recovery, in two tiers:
1. In-process: a supervisor task probes the peers every `probe_interval_s` and, when the
   gang is BROKEN (a rank died, a collective failed or hung), rebuilds it in the same
   bundles with exponential backoff. This is the fast path: the placement group stays
   reserved, only the rank processes and the process group are new.
2. Serve: after `max_rebuild_attempts` failed rebuilds, `check_health` raises and Serve
   replaces the whole replica (new placement group). If rank 0 itself (this process)
   dies, Serve does the same on its own.

Served weights are durable (service.weights.record), recorded by the app's Controller
(the record's one writer). Their rollout is service.weights.rollout: what every bring-up
loads (at either tier and on every restart of the app), the swaps of POST /weights
(`reload_weights`, `rollback_weights`), and the supervisor's move to a newer version
another replica of the app recorded; this class delegates to it.

The gang reports its status (and its metric snapshot) to the Controller at once on every
state change and every `tunables.fleet.report_interval_s`: that is what `/gangs`,
`/readyz` and weights rollouts read.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.util import get_current_placement_group

from service.transport import shm
from service.transport.channel import ChannelServer, sweep_stale_sockets
from service.config.builder_args import AppConfig
from service.contract.deadlines import local_deadline
from service.contract.errors import ErrorCode, GangUnavailable
from service.gang import failpoints
from service.gang import worker as rank_worker
from service.ingress.handle_errors import bounded_call
from service.gang.gang import Gang
from service.contract.gang_status import DataChannelStatus, GangState, GangStatus, RankMemory
from service.contract.timing import StepTimings
from service.gang.router import routing_stats
from service.metrics.logs import route_logs_to_serve
from service.metrics.process import enable_ray_metrics
from service.metrics.recorders import GangServerMetrics
from service.sessions import ids as session_ids
from service.sessions.service import SessionService, pool_of
from service.weights.rollout import Rollout
from service.state import artifacts
from service.state.paths import state_dir

log = logging.getLogger("gangserve.server")

# The supervisor's timing and bounds (service.config.tunables says why each value).


# Health-check periods and the graceful shutdown bound come from the tunables (service.app).
@serve.deployment(name="GangServer")
class GangServer:
    """Owns one Gang; answers inference and status calls from the ingress."""

    async def __init__(self, cfg: AppConfig, controller: DeploymentHandle) -> None:
        """`cfg`: the app's validated configuration (service.app binds the object itself)."""
        route_logs_to_serve()
        self._model = cfg.model
        self._tunables = cfg.tunables
        self._t = cfg.tunables.gang
        self._state = state_dir()
        context = serve.get_replica_context()
        self._app, self._replica_id = context.app_name, context.replica_id.unique_id
        enable_ray_metrics(cfg.tunables.fleet)
        self._metrics = GangServerMetrics(self._replica_id)  # here, not in the Gang: survives rebuilds
        loop = asyncio.get_running_loop()
        self._publishing: asyncio.Task | None = None  # a state report sent beside a rebuild
        self._wake = asyncio.Event()  # set when the gang turns BROKEN: the supervisor acts at once
        self._gang = Gang(self._model, cfg.gang, cfg.batching.policy, get_current_placement_group(), self._state,
                          on_step=self._metrics.on_step, on_drop=self._metrics.on_drop,
                          on_broken=lambda: loop.call_soon_threadsafe(self._wake.set), tunables=self._t,
                          state_tunables=cfg.tunables.state, sessions=pool_of(cfg), on_parts=self._metrics.step_parts)
        self._failed_rebuilds = 0
        self._node_id = ray.get_runtime_context().get_node_id()
        self._step_timings = StepTimings()
        self._memory: list[dict[str, object]] = []  # per CUDA rank, refreshed with the step timings
        self._timings_task: asyncio.Task | None = None
        self._controller = controller  # the weights record's writer and the fleet view's owner
        self._actor = ray.get_runtime_context().current_actor  # the Controller pings it
        # Tests only: lose a committed session append's answer (service.gang.failpoints.SESSION_APPEND).
        self._failpoints = failpoints.Failpoints(failpoints.SESSION_APPEND)
        # Same-node requests from the ingress may skip the handle call (service.transport.channel).
        self._channel = ChannelServer(
            self.infer, max_in_flight=cfg.serving.max_ongoing_requests + max(0, cfg.serving.max_queued_requests),
            session_append=self.session_append, tunables=cfg.tunables.transport,
            drop_append_reply=lambda: self._failpoints.take("session_append_reply_dropped"),
        )
        try:
            # Datasets, checkpoints and the served-weights copies: fail the start (with the
            # redacted URL and why) while the artifact store cannot be used.
            store = await asyncio.to_thread(artifacts.check_reachable, self._tunables.state)
            self._rollout = Rollout(self._gang, self._model, store, self._ask, self._app, self._t)
            await self._gang.start(await self._rollout.weights_at_start())
            if cfg.uses_data_channel:
                await asyncio.to_thread(sweep_stale_sockets, cfg.tunables.transport.stale_socket_s)
                await self._channel.start(self._replica_id)
        except Exception:
            self._channel.close()
            self._gang.shutdown()
            raise
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        self._sessions = SessionService(self._gang, cfg, self._replica_id,  # service.sessions
                                        await asyncio.to_thread(session_ids.app_key, self._app),
                                        on_append=self._metrics.session_append)
        self._sessions.start()

    async def infer(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    timeout_s: float | None = None) -> np.ndarray:
        """x: [batch, seq, E] float32 (validated by the ingress), key mask [batch, seq] bool
        (None: all tokens), causal (None: the model's default) -> [batch, seq, E] float32.
        `timeout_s`: the seconds left until the request's deadline (service.contract.deadlines):
        DeadlineExceeded then, and never computed if its step has not started."""
        with self._metrics.queued():
            return await self._gang.infer(x, mask, causal, local_deadline(timeout_s))

    async def infer_shared(self, ref: shm.SharedTensorRef, mask: np.ndarray | None = None,
                           causal: bool | None = None, timeout_s: float | None = None) -> tuple[int, ...]:
        """Same as `infer`, but the tensor travels through /dev/shm (see service.transport.shm).

        Reads the request from the pages `ref` names and writes the output into the same
        pages; only the ref (and the small mask, by value) and the reply's shape cross the handle call. Raises
        SharedMemoryUnavailable (the ingress then sends the tensor by value) when `ref`
        lives on another node or is gone.
        """
        view = shm.open_ref(ref, self._node_id)  # [batch, seq, E] float32
        with self._metrics.queued():
            out = await self._gang.infer(view, mask, causal, local_deadline(timeout_s))
        view[...] = out  # the ingress reads the reply from the same pages
        return tuple(int(d) for d in out.shape)

    # -- sessions (service.sessions; the ingress's routes: service.ingress.routes.sessions) -------
    # `session_id` is a keyword on every call: the request router sends a session's calls to
    # the gang whose replica id the session id names (service.gang.router).
    async def session_open(self, x: np.ndarray | None = None, timeout_s: float | None = None,
                           session_id: str | None = None) -> tuple[np.ndarray | None, dict[str, object]]:
        """A new session; `x` [n, E] float32: its first rows (outputs returned)."""
        return await self._sessions.open(x, local_deadline(timeout_s))

    async def session_append(self, x: np.ndarray, length: int | None = None, timeout_s: float | None = None,
                             session_id: str = "", idempotency_key: str | None = None
                             ) -> tuple[np.ndarray, dict[str, object]]:
        """x [n, E] float32 appended to the session -> (outputs [n, E], its info).
        `idempotency_key` (service.sessions.keys): a retry with the same key gets the first
        answer and appends nothing (service.sessions.service)."""
        with self._metrics.queued():
            answer = await self._sessions.append(session_id, x, local_deadline(timeout_s), length,
                                                 key=idempotency_key)
        if self._failpoints.take("session_append_answer_lost"):  # committed, then the answer is lost
            raise GangUnavailable("failpoint session_append_answer_lost: the append was committed and its "
                                  "answer dropped", code=ErrorCode.GANG_UNAVAILABLE)
        if self._failpoints.take("session_append_answer_late"):  # committed, then the answer is late
            await asyncio.sleep(failpoints.LATE_S)
        return answer

    async def session_oip(self, x: np.ndarray, start: bool, end: bool, timeout_s: float | None = None,
                          session_id: str = "", idempotency_key: str | None = None
                          ) -> tuple[np.ndarray, dict[str, object]]:
        """OIP v2 sequence semantics (Triton's sequence_id/start/end) on `session_id`;
        `idempotency_key` as session_append's."""
        with self._metrics.queued():
            return await self._sessions.oip(session_id, x, start, end, local_deadline(timeout_s),
                                            key=idempotency_key)

    async def session_info(self, timeout_s: float | None = None, session_id: str = "") -> dict[str, object]:
        return self._sessions.info(session_id)

    async def session_close(self, timeout_s: float | None = None, session_id: str = "") -> dict[str, object]:
        return self._sessions.close(session_id)

    async def reload_weights(self, checkpoint: str | None, job_id: str | None = None,
                             eval_loss: float | None = None) -> GangStatus:
        """Hot-swap to a dense checkpoint (an artifact key, or an absolute local path), or
        with `checkpoint=None` back to the app's configured weights, recorded as the app's
        next version (service.weights.rollout.Rollout.reload); returns the /gang
        description. Conflict (409) and nothing changes when it does not fit or a rank
        cannot stage it; in-flight and queued requests are unaffected."""
        await self._rollout.reload(checkpoint, job_id, eval_loss)
        await self._publish()  # the rollout's progress is read from the fleet view
        return await self.describe()

    async def rollback_weights(self, version: int) -> GangStatus:
        """Serve recorded version `version` again, recorded as the app's next version
        (service.weights.rollout.Rollout.rollback: 404 for a version never recorded, 409
        when it cannot be served again); returns the /gang description."""
        await self._rollout.rollback(version)
        await self._publish()
        return await self.describe()

    async def arm_failpoint(self, rank: int, name: str) -> None:
        """Tests only (the cluster must run with GANGSERVE_FAILPOINTS=1): make one rank fail
        once at a named point (see service.gang.failpoints)."""
        await self._gang.arm_failpoint(rank, name)

    async def arm_session_failpoint(self, name: str) -> None:
        """Tests only (GANGSERVE_FAILPOINTS=1): lose the answer of this gang server's next
        committed session append once, at a named point (service.gang.failpoints.SESSION_APPEND)."""
        self._failpoints.arm(name)

    async def describe(self) -> GangStatus:
        """GET /gang: the gang's report (service.contract.gang_status.GangStatus; the model itself
        crosses the handle call)."""
        sessions = getattr(self, "_sessions", None)
        status = self._gang.describe(
            replica_id=self._replica_id,
            failed_rebuilds=self._failed_rebuilds,
            # The ingress connects to channel.socket_path(replica_id) when this is true.
            data_channel=DataChannelStatus(listening=self._channel.path is not None, **self._channel.stats()),
            # Per-step timestamps of every rank (the control cost and the skew): the last
            # summary, refreshed in the background (readiness calls describe too, and must
            # never wait on a peer).
            step_timings=self._step_timings,
            memory=[RankMemory(**m) for m in self._memory],
            sessions=sessions.stats() if sessions is not None else None,
        )
        if self._gang.state is GangState.READY and (self._timings_task is None or self._timings_task.done()):
            self._timings_task = asyncio.get_running_loop().create_task(self._refresh_step_timings())
        return status

    async def _refresh_step_timings(self) -> None:
        self._step_timings = await self._gang.step_loop_stats()
        self._memory = await self._gang.memory_stats()

    def record_routing_stats(self) -> dict[str, object]:
        """Serve asks every tunables.gang.routing_stats_period_s; the router sends requests to ready gangs only."""
        return routing_stats(self._gang.state is GangState.READY, self._gang.weights_version)

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica (and gang)."""
        if rank_worker.abandoned is not None:  # a teardown that outlived its deadline: no new group here
            raise RuntimeError(f"rank 0's process cannot form a new process group: {rank_worker.abandoned}")
        if self._failed_rebuilds >= self._t.max_rebuild_attempts:
            raise RuntimeError(
                f"gang could not be rebuilt in {self._failed_rebuilds} attempts: {self._gang.reason}"
            )
        if self._supervisor.done():
            raise RuntimeError("gang supervisor stopped unexpectedly")

    async def _supervise(self) -> None:
        """Probe the peers; rebuild a broken gang with exponential backoff."""
        probed_at = published_at = 0.0
        published: GangState | None = None
        while self._gang.state is not GangState.STOPPED:
            try:  # a tick, or at once when the gang broke (a rebuild must not wait for the tick)
                await asyncio.wait_for(self._wake.wait(), timeout=self._t.supervisor_tick_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            now = time.monotonic()
            since_probe, since_publish = now - probed_at, now - published_at
            state = self._gang.state
            if since_publish >= self._tunables.fleet.report_interval_s or state is not published:
                # Periodically, and at once on a state change (so /gangs, /readyz see it).
                published_at, published = now, state
                if state is GangState.BROKEN:  # tell the fleet view beside the rebuild, not before it
                    self._publishing = asyncio.get_running_loop().create_task(self._publish())
                else:
                    await self._publish()
            if state is GangState.READY and since_probe >= self._t.probe_interval_s:
                probed_at = now
                await self._gang.probe()
                if await self._rollout.follow():
                    await self._publish()
            elif state is GangState.BROKEN:
                await self._rebuild_once()

    async def _publish(self) -> None:
        """This gang's description and metrics to the Controller (GET /gangs, /readyz,
        rollouts, /metrics); best effort: the next round retries."""
        try:
            info = await self.describe()
            await self._ask("report_gang", self._replica_id, info, self._metrics.snapshot(info), self._actor,
                            timeout_s=self._tunables.fleet.report_interval_s * 2)
        except Exception as exc:
            log.warning("could not report the gang's status to the controller: %s", exc)

    async def _ask(self, method: str, *args: Any, timeout_s: float) -> Any:
        """One call to the Controller, bounded by timeout_s; every failure is a GangServeError
        (503: the controller's own, e.g. `state_unavailable`, or `controller_*`)."""
        return await bounded_call(self._controller, method, *args, what="controller", timeout_s=timeout_s)

    async def _rebuild_once(self) -> None:
        cause = self._gang.reason
        if self._failed_rebuilds:
            delay = min(self._t.max_backoff_s, 2.0 ** (self._failed_rebuilds - 1))
            self._gang.health.explain(
                f"rebuild attempt {self._failed_rebuilds} failed ({cause}); retrying in {delay:.0f}s"
            )
            # The state stays BROKEN, so the supervisor loop would not report this reason
            # before the next attempt replaces it: report it now (/readyz, /gangs show it).
            await self._publish()
            await asyncio.sleep(delay)
        log.warning("rebuilding gang (attempt %d) after: %s", self._failed_rebuilds + 1, cause)
        self._gang.health.explain(f"rebuilding after: {cause}")
        try:
            await self._gang.rebuild(await self._rollout.recorded())
            self._metrics.rebuilt()
            self._failed_rebuilds = 0
            await self._publish()
        except Exception as exc:
            self._failed_rebuilds += 1
            log.error("gang rebuild attempt %d failed: %s", self._failed_rebuilds, exc)

    async def __del__(self) -> None:
        """Serve 2.60's graceful shutdown (scale-down, redeploy, `serve shutdown`, SIGTERM to
        `serve run`): Serve stops routing to this replica, waits for the handle calls it
        holds (up to `graceful_shutdown_timeout_s`), then awaits this. The data channel's
        requests are not Serve's: stop taking new ones (their clients fall back to the
        handle, routed to another replica) and let the accepted ones finish, and every
        request already in the gang's queue, before the gang goes."""
        drained = True
        channel = getattr(self, "_channel", None)
        gang = getattr(self, "_gang", None)
        if channel is not None and gang is not None:
            budget = asyncio.get_running_loop().time() + self._t.drain_timeout_s
            # The channel stops taking requests (its clients fall back to the handle), then
            # its accepted requests finish.
            drained = await channel.drain(self._t.drain_timeout_s)
            sessions = getattr(self, "_sessions", None)
            while not (gang.idle and (sessions is None or sessions.idle)) and \
                    asyncio.get_running_loop().time() < budget:
                await asyncio.sleep(0.02)
            drained = drained and gang.idle
            log.info("drained before shutdown: %s (data channel: %s)",
                     "yes" if drained else "no, timed out", channel.stats())
        self._shutdown()

    def _shutdown(self) -> None:
        # Leave the group, kill the peers.
        channel = getattr(self, "_channel", None)
        if channel is not None:
            channel.close()
        sessions = getattr(self, "_sessions", None)
        if sessions is not None:
            sessions.stop()
        gang = getattr(self, "_gang", None)
        if gang is not None:
            gang.shutdown()
        controller = getattr(self, "_controller", None)
        if controller is not None:
            try:  # fire and forget: a gang that cannot say goodbye is found dead by the watcher
                controller.withdraw_gang.remote(self._replica_id)
            except Exception:
                pass


