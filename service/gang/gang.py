"""The Gang: world_size ranks, one persistent process group, one sequencer.

The composition of the gang's three jobs, each in its own module:

- its lifecycle (service.gang.lifecycle): bring-up in named, bounded stages (create ->
  rendezvous -> load -> compile -> start_loop -> warmup), rebuild, teardown; rank 0 lives in
  this process (the GangServer replica), ranks 1..N-1 are Ray actors in the replica's
  placement group;
- its step runner (service.gang.runner): the sequencer (every operation that touches the
  ranks runs on ONE thread, so every rank sees one global order of collectives), the peers'
  step headers and heartbeats, and every step kind's one path (the kinds' table:
  service.gang.steps; the header: service.gang.control);
- its weights swap (service.gang.swap): stage everywhere, record, commit everywhere; every
  step carries the version the gang expects, so no answer mixes versions.

Failure model: the process group's timeout is `collective_timeout_s`, so a stuck peer
unblocks rank 0 at the latest then; independently, a request whose step has *executed*
longer than the deadline gets 504 at once. Either way the gang is marked BROKEN (one
`Health`, shared by the three), later requests get 503 immediately, and `rebuild()` (driven
by the GangServer's supervisor) kills the peers, leaves the group and brings the gang up
again in the same bundles. An idle gang sends heartbeat headers well inside the peers' wait
bound, so it outlives the group timeout; a peer whose rank 0 is gone exits on its own.

Around it: the batcher that forms steps from requests (service.gang.batching), the bounded
lifecycle calls to the peers (service.gang.peers), the warm spare (service.gang.spare), the
reading of failures (service.gang.failures), the rank itself (service.gang.rank).
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
from ray.util.placement_group import PlacementGroup

from service.config.builder_args import BatchPolicy, GangConfig, ModelConfig
from service.config.tunables import GangTunables, StateTunables
from service.contract.errors import ErrorCode, GangUnavailable, InvalidInput
from service.contract.gang_status import DataChannelStatus, GangState, GangStatus, RankMemory, SessionStats
from service.contract.timing import Part, StepTimings
from service.gang.batching import DropObserver, StepBatcher, StepObserver
from service.gang.failures import first_line
from service.gang.lifecycle import Lifecycle, SessionPool
from service.gang.runner import Health, Members, StepRunner
from service.gang.steps import Append, Forward
from service.gang.swap import WeightsSwap
from service.metrics import timeline
from service.parallel.paged_kernel import KernelStatus
from service.metrics.timeline import Timeline
from service.weights.served import ServedWeights

log = logging.getLogger("gangserve.gang")

__all__ = ["Gang", "SessionPool", "SessionStepPlan"]


class SessionStepPlan(Protocol):
    """What `Gang.session_step` runs (built by service.sessions.registry on the sequencer)."""

    sessions: int  # sessions in the step
    x: np.ndarray  # [T, E] float32: their new rows (recomputed ones: all kept rows), concatenated
    meta: Any  # torch int64: service.parallel.kv_cache.AppendPlan.encode()

    def commit(self, out: np.ndarray) -> Any: ...

    def abort(self) -> None: ...


class Gang:
    """Owns the rank actors and the process group of one tensor-parallel model."""

    def __init__(
        self, model: ModelConfig, gang: GangConfig, batching: BatchPolicy, placement_group: PlacementGroup | None,
        state_dir: Path,
        on_step: StepObserver | None = None,  # told of every step (the GangServer's metrics)
        on_drop: DropObserver | None = None,  # told of requests dropped uncomputed (deadline, cancelled)
        on_broken: Callable[[], None] | None = None,  # told (from any thread) when the gang turns BROKEN
        tunables: GangTunables = GangTunables(),  # the gang section (rank actors get it too)
        state_tunables: StateTunables = StateTunables(),  # the ranks' artifact store (checkpoints)
        sessions: SessionPool | None = None,  # the sessions' pool: allocated and compiled for at bring-up
        on_parts: Callable[[Timeline], None] | None = None,  # told of every step's parts (the metrics)
    ) -> None:
        self.cfg = gang
        self.state_dir = state_dir  # this node's state dir (recorded checkpoints are artifact keys)
        self._t = tunables
        self.health = Health(on_broken)
        self._members = Members()
        self._runner = StepRunner(self.health, self._members, gang, tunables, on_parts)
        self.lifecycle = Lifecycle(self.health, self._members, self._runner, model, gang, placement_group,
                                   tunables, state_tunables, sessions)
        self._swap = WeightsSwap(self.health, self._members, self._runner, self.lifecycle)
        self._batcher = StepBatcher(self._batched_step, batching, on_step=on_step, on_drop=on_drop)

    # -- what it is ------------------------------------------------------------------------
    @property
    def state(self) -> GangState:
        return self.health.state

    @property
    def reason(self) -> str:
        return self.health.reason

    @property
    def weights(self) -> ServedWeights | None:
        return self.lifecycle.weights

    @property
    def weights_version(self) -> int:
        return self.lifecycle.weights_version

    @property
    def generation(self) -> int:
        return self.lifecycle.generation

    @property
    def declared_model(self) -> ModelConfig:
        return self.lifecycle.declared_model

    @property
    def session_attention(self) -> KernelStatus:
        return self.lifecycle.session_attention

    @property
    def idle(self) -> bool:
        """No request queued or computing (a drain waits for this)."""
        return self._batcher.idle

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, weights: ServedWeights) -> None:
        """Bring the gang up serving `weights` (the app's recorded version)."""
        await self._runner.run(self.lifecycle.bring_up, weights)

    async def rebuild(self, weights: ServedWeights) -> None:
        """Tear the gang down and bring it up again in the same bundles (new group, new pids),
        serving `weights` (the caller reads the record: the last good recorded version)."""
        if self.state is GangState.STOPPED:
            return
        self.health.set(GangState.REBUILDING, self.reason)
        await self._runner.run(self.lifecycle.rebuild, weights)

    async def probe(self) -> None:
        """Ask every peer for a sign of life; a dead or stopped peer marks the gang BROKEN."""
        if self.state is GangState.READY and self._members.peers:
            await self._runner.run(self.lifecycle.probe)

    async def arm_failpoint(self, rank: int, name: str) -> None:
        """Tests only: make `rank` fail once at failpoint `name` (see service.gang.failpoints)."""
        self.health.require_ready()
        await self._runner.run(self.lifecycle.arm_failpoint, rank, name)

    def shutdown(self) -> None:
        """Leave the process group and kill the peer actors. Safe to call twice."""
        if self.state is GangState.STOPPED:
            return
        self.health.set(GangState.STOPPED, "shut down")
        self._runner.stop_loop()
        # Killing the peers first unblocks rank 0 if it is inside a collective; then rank 0
        # leaves the group on the sequencer thread, never concurrently with a step.
        if self._members.peers is not None:
            self._members.peers.kill()
        try:
            self._runner.submit(lambda: (self.lifecycle.teardown(), self.lifecycle.spare.drop())).result(
                timeout=self._t.shutdown_timeout_s)
        except Exception:
            log.exception("gang teardown did not finish within %.0fs", self._t.shutdown_timeout_s)
        self._runner.shutdown()

    # -- steps -----------------------------------------------------------------------------
    async def infer(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    deadline: float | None = None) -> np.ndarray:
        """x [batch, seq, E] float32, key mask [batch, seq] bool (None: all tokens), causal
        (None: the served weights' default) -> attention output [batch, seq, E] float32.
        `deadline` (time.monotonic(), None: none): DeadlineExceeded then; a request whose
        deadline passes before its step starts is never computed (service.gang.batching)."""
        self.health.require_ready()
        root = self._members.root
        if causal is False and root is not None and root.causal_only:
            raise InvalidInput(f"model {self.declared_model.kind} is causal by declaration (a decoder: each row "
                               "attends only the rows before it); leave causal out or set it true")
        return await self._batcher.submit(x, mask, causal, deadline)

    async def _batched_step(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                            deadline: float | None = None) -> np.ndarray:
        # Before queueing on the sequencer: a group the batcher forms after the gang broke
        # must not wait behind the rebuild (its create stage may wait out stage_timeout_s
        # for a lost node), only to be refused then. Checked and submitted in one go on the
        # event loop, where the supervisor submits the rebuild, so no rebuild slips between.
        self.health.require_ready()
        return await self._runner.run(self._forward, x, mask, causal, timeline.current_step(),
                                      step_timeout_s=self.cfg.collective_timeout_s, request_deadline=deadline)

    def _forward(self, x: np.ndarray, mask: np.ndarray | None, causal: bool | None,
                 marks: Timeline | None) -> np.ndarray:
        if marks is not None:
            marks.mark(Part.HANDOFF)  # the event loop -> the sequencer thread
        # Requests queued behind a failure must not touch the broken group.
        self.health.require_ready()
        root = self._members.require_root()
        # None = the served weights' default, read here on the sequencer: the same weights
        # this step runs on (a swap is sequenced between steps).
        step = Forward(x, mask, root.default_causal if causal is None else bool(causal))
        return self._runner.run_step(step, self.weights_version, marks)

    async def session_step(self, prepare: Callable[[int, int], SessionStepPlan],
                           deadline: float | None = None) -> Any:
        """One append step of sessions (service.sessions), sequenced like a request.

        On the sequencer, `prepare(generation, weights_version)` is asked for the step (the
        registry decides placements against the gang as it is *now*: a rebuild bumped the
        generation and emptied every pool, a swap changed the version, so their sessions
        are recomputed); then the step runs (an append step, service.gang.steps.APPEND), and the
        plan's `commit(out)` (after success) or `abort()` (after any failure) runs there too.
        Returns what `commit` returns. Failures map as for `infer` (the gang turns BROKEN). The
        step's parts go on the timeline the calling task runs (`timeline.current_step()`), if any."""
        self.health.require_ready()
        return await self._runner.run(self._session_step, prepare, timeline.current_step(),
                                      step_timeout_s=self.cfg.collective_timeout_s, request_deadline=deadline)

    def _session_step(self, prepare: Callable[[int, int], SessionStepPlan], marks: Timeline | None) -> Any:
        if marks is not None:
            marks.mark(Part.HANDOFF)  # the event loop -> the sequencer thread
        self.health.require_ready()
        plan = prepare(self.generation, self.weights_version)
        if not plan.sessions:  # every session of the step ended meanwhile: nothing to compute
            return plan.commit(np.zeros((0, self.declared_model.embed_dim), dtype=np.float32))
        try:
            out = self._runner.run_step(Append(plan.sessions, plan.x, plan.meta), self.weights_version, marks)
        except BaseException:
            plan.abort()
            raise
        if self.state is not GangState.READY:  # timed out meanwhile (the caller got 504): keep nothing
            plan.abort()
            raise GangUnavailable(f"the gang broke during the append step: {self.reason}", code=ErrorCode.GANG_BROKEN)
        return plan.commit(out)

    def kv_pool_bytes(self) -> int:
        """Rank 0's KV pool, bytes on its device (every rank's pool has the same shape)."""
        root = self._members.root
        return root.kv_pool_bytes() if root is not None else 0

    # -- weights ---------------------------------------------------------------------------
    async def swap_weights(self, model: ModelConfig, record: Callable[[], ServedWeights]) -> ServedWeights:
        """Hot-swap every rank's shard to `model`'s weights, atomically across ranks
        (service.gang.swap). Driven by service.weights.rollout only (what to swap to, and how
        it is recorded)."""
        self.health.require_ready()
        return await self._runner.run(self._swap.swap, model, record)

    # -- reports ---------------------------------------------------------------------------
    async def step_loop_stats(self, window: int = 32) -> StepTimings:
        """Where the last `window` steps' time went (service.gang.runner.StepRunner.loop_stats)."""
        return await self._runner.loop_stats(window)

    async def memory_stats(self) -> list[dict[str, object]]:
        """Each CUDA rank's device memory (Rank.memory_stats: the caching allocator's
        `memory_reserved_bytes` and its peak, allocated, pinned host buffers), with its rank;
        [] when no rank is on CUDA (no peer is asked then). Off the sequencer, like the step
        timings: a stats read never waits behind a step, and never fails /gang."""
        root, peers_group = self._members.root, self._members.peers
        if root is None or self.state is not GangState.READY or not any(
                i.has_cuda for i in self.lifecycle.rank_infos):
            return []
        try:
            peers = await asyncio.to_thread(peers_group.call, "memory_stats", stage="memory stats",
                                            timeout_s=self._t.stats_timeout_s, tick=False) if peers_group else []
        except Exception as exc:  # noqa: BLE001  (a stats read must never fail /gang)
            log.warning("memory stats not read: %s", first_line(exc))
            peers = []
        return [{"rank": rank, **stats} for rank, stats in enumerate([root.memory_stats(), *peers]) if stats]

    def describe(self, *, replica_id: str, failed_rebuilds: int, data_channel: DataChannelStatus,
                 step_timings: StepTimings, memory: list[RankMemory] | None = None,
                 sessions: SessionStats | None = None) -> GangStatus:
        """The gang's report (GET /gang): its own fields, and its GangServer's (given here, so
        the report is built whole, in one place, and checked as it is built). `memory` and
        `sessions` stay absent from the report when None (a CPU gang; sessions off)."""
        life = self.lifecycle
        weights = life.weights.public() if life.weights else {"weights_version": 0, "weights_source": None}
        extra: dict[str, object] = {}
        if memory:
            extra["memory"] = memory
        if sessions is not None:
            extra["sessions"] = sessions
        return GangStatus(
            world_size=self.cfg.world_size,
            backend=life.backend,
            state=self.state.value,
            reason=self.reason,
            **weights,
            generation=life.generation,
            last_bring_up=life.last_bring_up,
            spare=life.spare.status(),
            param_bytes_per_rank=list(life.param_bytes_per_rank),
            batching=self._batcher.stats(),
            ranks=[info.public() for info in life.rank_infos],
            failed_rebuilds=failed_rebuilds,
            replica_id=replica_id,
            data_channel=data_channel,
            step_timings=step_timings,
            **extra,
        )
