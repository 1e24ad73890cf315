"""The Gang: world_size ranks, one persistent process group, one sequencer.

Rank 0 is a `RankWorker` living in the calling process (the GangServer replica); ranks
1..N-1 are Ray actors pinned to bundles 1..N-1 of the replica's placement group (Serve
reserves all bundles at once, so the gang is placed all-or-nothing).

Bring-up runs in named stages, each bounded: create -> rendezvous -> load -> warmup.

Weights: the gang serves one recorded version (`ServedWeights`, see service.weights.record)
at a time. Every rank holds the version number of its weights, and every step message
carries the version the gang expects: a rank that disagrees poisons its contribution and
refuses the step, so no answer is ever computed from mixed versions. A swap stages the new
shard on every rank (any failure: the old weights stay in force everywhere), then records
the new version durably, then commits it on every rank; a failed commit marks the gang
BROKEN and the rebuild loads the recorded version.

Sequencer: every operation that touches the ranks (bring-up, inference, weight swap,
liveness probe, teardown) runs on ONE thread. Rank 0 sends the peers' step headers and
lifecycle calls and then runs its own side; the peers take both in the order sent, so all
ranks see one global sequence of collectives and concurrent requests cannot deadlock.

Steps (the step loop; protocol in service.gang.control): after bring-up the peers block
in a broadcast of a small header from rank 0 on the gang's gloo control group; a step is
one header, never a Ray call (a gang of one rank has no peers to tell). The sequencer
sends each step's header before rank 0 prepares its own input (a late follower stalls the
first collective), and a heartbeat header whenever no header went out for a quarter of
`collective_timeout_s`, also while it waits on lifecycle Ray calls (staging weights can
take longer than the group timeout). Lifecycle operations stay Ray calls
(service.gang.peers), issued by the sequencer between steps. A peer refusing a step for its weights version records why before the all_reduce;
rank 0, seeing the poisoned output, asks it over Ray (`step_error`).

Failure model: the process group's timeout is `collective_timeout_s`, so a stuck peer
unblocks rank 0 at the latest then; independently, a request whose step has *executed*
longer than the deadline gets 504 at once. Either way the gang is marked BROKEN, later
requests get 503 immediately, and `rebuild()` (driven by the GangServer's supervisor)
kills the peers, leaves the group and brings the gang up again in the same bundles.

Its parts live beside it: the sequencer thread and its deadlines (service.gang.sequencer),
the bounded lifecycle calls to the peers (service.gang.peers: every one goes through
`PeerGroup.call`), the warm spare
(service.gang.spare), the reading of failures (service.gang.failures), the step loop's
header protocol (service.gang.control), the rank itself (service.gang.rank).
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import threading
import time
from dataclasses import dataclass
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

import numpy as np
import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.config.builder_args import GangConfig, ModelConfig
from service.contract.errors import (CollectiveTimeout, Conflict, ErrorCode, GangServeError, GangStartupError, GangUnavailable,
                                     InvalidInput, gang_state_code)
from service.config.builder_args import BatchPolicy
from service.gang.batching import DropObserver, StepBatcher, StepObserver
from service.cluster.placement import GangUnschedulable, check_feasible, cluster_snapshot, gang_request, waiting_reason
from service.gang import control
from service.gang.failures import PeerCallFailed, cause, first_line, is_timeout, is_version_mismatch
from service.gang.peers import Calls, PeerGroup
from service.gang.rank import RankInfo, RankWorker
from service.gang.sequencer import Sequencer
from service.gang.spare import WarmSpare
from service.gang.steps import Append, Forward, StepKind
from service.parallel.paged_kernel import KernelStatus
from service.contract.gang_status import DataChannelStatus, GangState, GangStatus, RankMemory, SessionStats
from service.metrics import timeline
from service.weights.record import ServedWeights
from service.config.tunables import GangTunables, StateTunables

log = logging.getLogger("gangserve.gang")
T = TypeVar("T")


RankActor = ray.remote(max_restarts=0, max_task_retries=0)(RankWorker)


@dataclass(frozen=True)
class SessionPool:
    """The sessions' KV pool every rank holds (service.sessions.service.pool_of): its pages."""

    num_blocks: int
    block_size: int


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
    ) -> None:
        self._t = tunables
        self._state_t = state_tunables
        self._on_broken = on_broken
        self._session_pool = sessions if sessions is not None and sessions.num_blocks > 0 else None
        # Which attention the session steps use, and why (the bring-up's `compile` stage; GET /gang).
        self.session_attention = KernelStatus("gather", "sessions are off (no KV pool)" if self._session_pool is None
                                              else "not brought up yet")
        self._broken_at: float | None = None  # when the gang last turned BROKEN (rebuild timings)
        self.declared_model = model  # the builder's model args; each version's checkpoint overrides theirs
        self.cfg = gang
        self.placement_group = placement_group
        self.state_dir = state_dir  # this node's state dir (recorded checkpoints are artifact keys)
        self.state = GangState.STARTING
        self.reason = "starting"
        self.backend = "unknown"
        self.weights: ServedWeights | None = None  # the version every rank holds (None: none yet)
        self.generation = 0  # bumps on every successful bring-up
        self.rank_infos: list[RankInfo] = []
        self.param_bytes_per_rank: list[int] = []
        # The last (re)build's stages, ms (GET /gang `last_bring_up`): where a rebuild's time goes.
        self.last_bring_up: dict[str, float] = {}
        self._root: RankWorker | None = None
        # An idle rank process, adopted by a rebuild (service.gang.spare).
        self._spare = WarmSpare(gang, placement_group, RankActor, tunables, state_tunables)
        # Step loop state (sequencer thread only, except the heartbeat timer's reads).
        self._loop_on = False  # the peers' loops run (every bring-up with peers starts them)
        self._seq = 0  # last header sequence number sent
        self._last_header = time.monotonic()
        self._heartbeat_queued = False
        self._heartbeat_s = tunables.heartbeat_interval(gang.collective_timeout_s)
        self._peer_answer_s = min(tunables.peer_answer_timeout_s, gang.collective_timeout_s)
        self._peers = self._new_peers([])  # ranks 1..N-1 of the current generation
        self._heartbeats_stop: threading.Event | None = None  # set to end this generation's timer
        # rank 0's (seq, received, header sent, broadcast done, forward done, reply), ns
        self._timings: list[tuple[int, int, int, int, int, int]] = []
        self._header_sent_ns = 0  # when the last step's header went out (monotonic; the timeline's `header`)
        # One thread = one global order of collectives (service.gang.sequencer).
        self._sequencer = Sequencer(on_stuck=self._mark_broken)
        self._batcher = StepBatcher(self._batched_step, batching, on_step=on_step, on_drop=on_drop)

    # -- public, async -------------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        return self.weights.version if self.weights else 0

    @property
    def _actors(self) -> list[Any]:
        """The peer rank actors (ranks 1..N-1), in rank order."""
        return self._peers.actors

    async def start(self, weights: ServedWeights) -> None:
        """Bring the gang up serving `weights` (the app's recorded version)."""
        await self._sequencer.run(self._bring_up, weights)

    async def rebuild(self, weights: ServedWeights) -> None:
        """Tear the gang down and bring it up again in the same bundles (new group, new pids),
        serving `weights` (the caller reads the record: the last good recorded version)."""
        if self.state is GangState.STOPPED:
            return
        self.state = GangState.REBUILDING
        await self._sequencer.run(self._rebuild, weights)

    async def infer(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    deadline: float | None = None) -> np.ndarray:
        """x [batch, seq, E] float32, key mask [batch, seq] bool (None: all tokens), causal
        (None: the served weights' default) -> attention output [batch, seq, E] float32.
        `deadline` (time.monotonic(), None: none): DeadlineExceeded then; a request whose
        deadline passes before its step starts is never computed (service.gang.batching)."""
        self._require_ready()
        if causal is False and self._root is not None and self._root.causal_only:
            raise InvalidInput(f"model {self.declared_model.kind} is causal by declaration (a decoder: each row "
                               "attends only the rows before it); leave causal out or set it true")
        return await self._batcher.submit(x, mask, causal, deadline)

    @property
    def idle(self) -> bool:
        """No request queued or computing (a drain waits for this)."""
        return self._batcher.idle

    async def _batched_step(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                            deadline: float | None = None) -> np.ndarray:
        received_ns = time.time_ns()
        # Before queueing on the sequencer: a group the batcher forms after the gang broke
        # must not wait behind the rebuild (its create stage may wait out stage_timeout_s
        # for a lost node), only to be refused then. Checked and submitted in one go on the
        # event loop, where the supervisor submits the rebuild, so no rebuild slips between.
        self._require_ready()
        return await self._sequencer.run(self._infer_step, x, mask, causal, received_ns, timeline.current_step(),
                                         step_timeout_s=self.cfg.collective_timeout_s, request_deadline=deadline)

    async def session_step(self, prepare: Callable[[int, int], "SessionStepPlan"],
                           deadline: float | None = None) -> Any:
        """One append step of sessions (service.sessions), sequenced like a request.

        On the sequencer, `prepare(generation, weights_version)` is asked for the step (the
        registry decides placements against the gang as it is *now*: a rebuild bumped the
        generation and emptied every pool, a swap changed the version, so their sessions
        are recomputed); then the step runs (service.gang.control OP_APPEND), and the plan's
        `commit(out)` (after success) or `abort()` (after any failure) runs there too. Returns
        what `commit` returns. Failures map as for `infer` (the gang turns BROKEN)."""
        self._require_ready()
        return await self._sequencer.run(self._session_step, prepare, time.time_ns(), timeline.current_step(),
                                         step_timeout_s=self.cfg.collective_timeout_s, request_deadline=deadline)

    def kv_pool_bytes(self) -> int:
        """Rank 0's KV pool, bytes on its device (every rank's pool has the same shape)."""
        return self._root.kv_pool_bytes() if self._root is not None else 0

    def _session_step(self, prepare: Callable[[int, int], "SessionStepPlan"], received_ns: int,
                      marks: timeline.StepMarks | None = None) -> Any:
        if marks is not None:
            marks.mark("handoff")  # the event loop -> the sequencer thread
        self._require_ready()
        plan = prepare(self.generation, self.weights_version)
        if not plan.sessions:  # every session of the step ended meanwhile: nothing to compute
            return plan.commit(np.zeros((0, self.declared_model.embed_dim), dtype=np.float32))
        try:
            out = self._run_step(Append(plan.sessions, plan.x, plan.meta), received_ns)
        except BaseException:
            plan.abort()
            raise
        if self.state is not GangState.READY:  # timed out meanwhile (the caller got 504): keep nothing
            plan.abort()
            raise GangUnavailable(f"the gang broke during the append step: {self.reason}", code=ErrorCode.GANG_BROKEN)
        if marks is not None:
            self._mark_step(marks)
        return plan.commit(out)

    async def swap_weights(
        self, model: ModelConfig, record: Callable[[], ServedWeights]
    ) -> ServedWeights:
        """Hot-swap every rank's shard to `model`'s weights, atomically across ranks.

        Sequenced like a request: earlier requests finish on the old weights, later ones
        see the new. Phases: stage on every rank (a failure anywhere discards the staged
        shards: the old weights stay in force everywhere, Conflict/GangUnavailable), then
        `record()` (durably assigns the new version; it runs on the sequencer, after staging
        succeeded everywhere), then commit that version on every rank. A failed commit
        marks the gang BROKEN: the rebuild loads the recorded version, never a mix.
        Driven by service.weights.rollout only (what to swap to, and how it is recorded).
        """
        self._require_ready()
        return await self._sequencer.run(self._swap_weights, model, record)

    async def arm_failpoint(self, rank: int, name: str) -> None:
        """Tests only: make `rank` fail once at failpoint `name` (see service.gang.failpoints)."""
        self._require_ready()
        await self._sequencer.run(self._arm_failpoint, rank, name)

    async def probe(self) -> None:
        """Ask every peer for a sign of life; a dead or stopped peer marks the gang BROKEN."""
        if self.state is GangState.READY and self._actors:
            await self._sequencer.run(self._probe_step)

    async def step_loop_stats(self, window: int = 32) -> dict[str, object]:
        """Where the last `window` steps' time went, from every rank's timestamps (medians, ms):
        `queue` (step handed to the sequencer -> header sent), `peer_wake` (header sent ->
        each peer awake: the control cost), `skew` (the latest peer's wake-up minus rank
        0's header send: how late the first collective starts), `broadcast` and `forward`
        (rank 0: header sent -> data broadcast done -> all_reduce done), `reply` (rank 0's
        output copied out). Wall clocks: across nodes, skew includes their clock offset."""
        if not self._loop_on:
            return {"enabled": False}
        mine = {t[0]: t for t in self._timings[-window:]}
        group = self._peers
        try:  # off the sequencer (a stats read never waits behind a step): no heartbeats from here
            peers = await asyncio.to_thread(group.call, "loop_timings", stage="step timings",
                                            timeout_s=self._t.stats_timeout_s, tick=False)
        except Exception as exc:  # a stats read must never fail /gang
            return {"enabled": True, "error": f"{type(exc).__name__}: {first_line(exc)}"}
        by_peer = [{t[0]: t for t in p} for p in peers]
        seqs = [s for s in mine if all(s in p for p in by_peer)]
        if not seqs:
            return {"enabled": True, "steps": 0, "heartbeat_s": self._heartbeat_s}

        def med(values: list[float]) -> float:
            return round(statistics.median(values) / 1e6, 3)

        wake = [[p[s][2] - mine[s][2] for s in seqs] for p in by_peer]
        return {
            "enabled": True, "steps": len(seqs), "heartbeat_s": self._heartbeat_s,
            "queue_ms": med([mine[s][2] - mine[s][1] for s in seqs]),
            "peer_wake_ms": [med(w) for w in wake],
            "skew_ms": med([max(w[i] for w in wake) for i in range(len(seqs))]),
            "broadcast_ms": med([mine[s][3] - mine[s][2] for s in seqs]),
            "forward_ms": med([mine[s][4] - mine[s][3] for s in seqs]),
            "reply_ms": med([mine[s][5] - mine[s][4] for s in seqs]),
        }

    async def memory_stats(self) -> list[dict[str, object]]:
        """Each CUDA rank's device memory (Rank.memory_stats: the caching allocator's
        `memory_reserved_bytes` and its peak, allocated, pinned host buffers), with its rank;
        [] when no rank is on CUDA (no peer is asked then). Off the sequencer, like the step
        timings: a stats read never waits behind a step, and never fails /gang."""
        root = self._root
        if root is None or self.state is not GangState.READY or not any(i.has_cuda for i in self.rank_infos):
            return []
        try:
            peers = await asyncio.to_thread(self._peers.call, "memory_stats", stage="memory stats",
                                            timeout_s=self._t.stats_timeout_s, tick=False) if self._actors else []
        except Exception as exc:  # noqa: BLE001  (a stats read must never fail /gang)
            log.warning("memory stats not read: %s", first_line(exc))
            peers = []
        return [{"rank": rank, **stats} for rank, stats in enumerate([root.memory_stats(), *peers]) if stats]

    def describe(self, *, replica_id: str, failed_rebuilds: int, data_channel: DataChannelStatus,
                 step_timings: dict[str, object], memory: list[RankMemory] | None = None,
                 sessions: SessionStats | None = None) -> GangStatus:
        """The gang's report (GET /gang): its own fields, and its GangServer's (given here, so
        the report is built whole, in one place, and checked as it is built). `memory` and
        `sessions` stay absent from the report when None (a CPU gang; sessions off)."""
        weights = self.weights.public() if self.weights else {"weights_version": 0, "weights_source": None}
        extra: dict[str, object] = {}
        if memory:
            extra["memory"] = memory
        if sessions is not None:
            extra["sessions"] = sessions
        return GangStatus(
            world_size=self.cfg.world_size,
            backend=self.backend,
            state=self.state.value,
            reason=self.reason,
            **weights,
            generation=self.generation,
            last_bring_up=self.last_bring_up,
            spare=self._spare.status(),
            param_bytes_per_rank=list(self.param_bytes_per_rank),
            batching=self._batcher.stats(),
            ranks=[info.public() for info in self.rank_infos],
            failed_rebuilds=failed_rebuilds,
            replica_id=replica_id,
            data_channel=data_channel,
            step_timings=step_timings,
            **extra,
        )

    def shutdown(self) -> None:
        """Leave the process group and kill the peer actors. Safe to call twice."""
        if self.state is GangState.STOPPED:
            return
        self.state, self.reason = GangState.STOPPED, "shut down"
        self._stop_heartbeats()
        # Killing the peers first unblocks rank 0 if it is inside a collective; then rank 0
        # leaves the group on the sequencer thread, never concurrently with a step.
        self._peers.kill()
        try:
            self._sequencer.submit(lambda: (self._teardown(), self._spare.drop())).result(timeout=self._t.shutdown_timeout_s)
        except Exception:
            log.exception("gang teardown did not finish within %.0fs", self._t.shutdown_timeout_s)
        self._sequencer.shutdown()

    # -- helpers -------------------------------------------------------------------------
    def _require_ready(self) -> None:
        if self.state is not GangState.READY:
            raise GangUnavailable(
                f"gang is {self.state.value}: {self.reason}", code=gang_state_code(self.state.value)
            )

    def _new_peers(self, actors: list[Any]) -> PeerGroup:
        """A generation's peers: waits bounded by stage_timeout_s, heartbeats sent while
        the sequencer waits, a dead peer marks this generation BROKEN."""
        return PeerGroup(actors, self.cfg.stage_timeout_s, on_died=self._peer_died,
                         on_wait=self._heartbeat_if_idle, wait_slice_s=self._heartbeat_s / 2)

    def _peer_died(self, group: PeerGroup, rank: int, stage: str) -> None:
        if group is self._peers:  # a call to an earlier generation's peers breaks nothing now
            self._mark_broken(f"rank {rank} died during {stage}")

    def _placement_diagnosis(self) -> str:
        """Needed vs free, in the words of the fail-fast check (best effort)."""
        try:
            snapshot, request = cluster_snapshot(), gang_request(self.cfg)
            try:
                check_feasible(snapshot, request)
            except GangUnschedulable as exc:
                return exc.message
            return waiting_reason(snapshot, request)
        except Exception as exc:  # diagnosis must never hide the real error
            return f"(placement unknown: {type(exc).__name__})"

    # -- sequencer-side steps ------------------------------------------------------------
    def _bring_up(self, weights: ServedWeights, prior: dict[str, float] | None = None) -> None:
        """Bring every rank up serving `weights`; `prior`: stage timings already spent
        (the rebuild's teardown), reported with this bring-up's in `last_bring_up`."""
        cfg, ws = self.cfg, self.cfg.world_size
        model = weights.model_config(self.declared_model)
        started = time.monotonic()
        stages = _StageClock()
        try:
            # Stage 1: create. Rank 0 is this process; peers go to bundles 1..N-1, one of
            # them the warm spare when it is warm and on that rank's node.
            self._root = RankWorker(0, ws, use_gpu=cfg.use_gpu, torch_threads=cfg.threads_per_rank,
                                    allow_tf32=cfg.allow_tf32, tunables=self._t, state_tunables=self._state_t)
            previous_nodes = {info.rank: info.node_id for info in self.rank_infos}  # bundles stay put
            self._peers, refs = self._new_peers([]), []  # filled as they start: a teardown kills any
            actors = self._peers.actors
            for rank in range(1, ws):  # each rank its own first call: the spare's adopt, a new one's describe
                spare = self._spare.take(previous_nodes.get(rank))
                if spare is not None:
                    actors.append(spare)
                    refs.append(spare.adopt.remote(rank))
                    stages.adopted = rank
                else:
                    actors.append(self._spawn_actor(rank))
                    refs.append(actors[-1].describe.remote())
            # A late `create` is most likely an unplaced bundle (e.g. a node was lost): needed vs free.
            peer_infos = self._peers.collect(Calls(list(range(1, ws)), refs), stage="create",
                                             diagnose=self._placement_diagnosis)
            self.rank_infos = [self._root.describe(), *peer_infos]
            self.backend = self._choose_backend(self.rank_infos)
            stages.done("create")

            # Stage 2: rendezvous at rank 0's node IP and an OS-chosen port.
            port = self._root.open_store(cfg.collective_timeout_s) if ws > 1 else 0
            host = self._root.info.node_ip
            calls = self._peers.submit("rendezvous", host, port, self.backend, cfg.collective_timeout_s)
            self._root.rendezvous(host, port, self.backend, cfg.collective_timeout_s)
            self._peers.collect(calls, stage="rendezvous")
            stages.done("rendezvous")

            # Stage 3: load. Each rank reads only its own slice of the recorded version.
            calls = self._peers.submit("load_weights", model, weights.version)
            root_bytes = self._root.load_weights(model, weights.version)
            self.param_bytes_per_rank = [root_bytes, *self._peers.collect(calls, stage="load")]
            self.weights = weights
            stages.done("load")

            # Stage 3b: compile (sessions). Each rank alone, no collective: allocate its KV pool
            # and compile the in-place attention over it, so no user's append ever compiles.
            if self._session_pool is not None:
                self._warm_sessions(self._session_pool)
                stages.done("compile")

            # Stage 4: the peers' step loops (from here on a peer's wait is bounded by the
            # control group's timeout, so heartbeats start with them).
            if ws > 1:
                self._peers.call("start_loop", stage="start step loop")
                self._loop_on, self._seq, self._last_header = True, 0, time.monotonic()
                self._start_heartbeats()
                stages.done("start_loop")

            # Stage 5: warmup. One tiny request proves every collective path works.
            self._run_step(Forward(np.zeros((1, 1, model.embed_dim), dtype=np.float32),
                                   causal=self._root.default_causal))
            stages.done("warmup")
        except Exception as exc:
            self._teardown()
            self.state, self.reason = GangState.BROKEN, f"bring-up failed: {exc}"
            raise
        self.generation += 1
        self.state, self.reason = GangState.READY, "ready"
        self.last_bring_up = {"ms": {**(prior or {}), **stages.ms}, "spare_adopted_as_rank": stages.adopted}
        self._spare.start()  # after READY: its start never delays serving
        log.info(
            "gang ready (generation %d): world_size=%d backend=%s in %.1fs (stages, ms: %s); weights version %d "
            "(%s, %s); pids %s", self.generation, ws, self.backend, time.monotonic() - started,
            self.last_bring_up, weights.version, weights.source, weights.description, [i.pid for i in self.rank_infos],
        )

    def _warm_sessions(self, pool: SessionPool) -> None:
        """Every rank's `warm_sessions` at once (bounded by stage_timeout_s; each rank's compiling
        by tunables.gang.session_compile_budget_s), and one log line saying which path runs."""
        assert self._root is not None
        budget = min(self._t.session_compile_budget_s, self.cfg.stage_timeout_s / 2)
        args = (pool.num_blocks, pool.block_size, self._t.session_attention, budget)
        calls = self._peers.submit("warm_sessions", *args)
        ranks = [self._root.warm_sessions(*args), *self._peers.collect(calls, stage="compile")]
        paths = {r.path for r in ranks}
        path = paths.pop() if len(paths) == 1 else "mixed"
        first = next((r for r in ranks if r.path != "in_place"), ranks[0])
        self.session_attention = KernelStatus(path, first.reason, max(r.compile_s for r in ranks),
                                              min(r.shapes for r in ranks))
        if path == "in_place":
            log.info("session attention: in place over the KV pool's blocks on every rank (%d shapes compiled, "
                     "%.1f s at most per rank)", self.session_attention.shapes, self.session_attention.compile_s)
        else:
            log.warning("session attention: the gather path (%s) on ranks %s: %s", path,
                        [i for i, r in enumerate(ranks) if r.path != "in_place"], first.reason)

    def _rebuild(self, weights: ServedWeights) -> None:
        stages = _StageClock()
        if self._broken_at is not None:  # detection -> the supervisor's decision -> this thread
            stages.ms["broken_to_rebuild"] = round((stages.started - self._broken_at) * 1000, 1)
            self._broken_at = None
        self._teardown()
        stages.done("teardown")
        self._bring_up(weights, prior=stages.ms)

    def _teardown(self) -> None:
        self._loop_on = False  # no more headers: the group is going
        self._stop_heartbeats()
        self._peers.kill()
        self._peers = self._new_peers([])
        if self._root is not None:
            try:
                self._root.close()
            except Exception:  # the group may be broken; we are leaving it anyway
                log.exception("closing rank 0's process group failed")
            self._root = None

    def _spawn_actor(self, rank: int) -> Any:
        options: dict[str, Any] = {
            "num_cpus": self.cfg.cpus_per_rank,
            "num_gpus": 1 if self.cfg.use_gpu else 0,
        }
        if self.placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank
            )
        return RankActor.options(**options).remote(
            rank, self.cfg.world_size, use_gpu=self.cfg.use_gpu, torch_threads=self.cfg.threads_per_rank,
            allow_tf32=self.cfg.allow_tf32, tunables=self._t, state_tunables=self._state_t,
        )

    def _choose_backend(self, infos: list[RankInfo]) -> str:
        all_cuda = all(i.has_cuda for i in infos)
        if self.cfg.backend == "nccl" and not all_cuda:
            missing = [i.rank for i in infos if not i.has_cuda]
            raise GangStartupError(
                f"backend=nccl needs a CUDA device on every rank; ranks {missing} have none"
            )
        if self.cfg.backend == "gloo":
            return "gloo"
        return "nccl" if all_cuda else "gloo"

    def _infer_step(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    received_ns: int = 0, marks: timeline.StepMarks | None = None) -> np.ndarray:
        if marks is not None:
            marks.mark("handoff")  # the event loop -> the sequencer thread
        # Requests queued behind a failure must not touch the broken group.
        self._require_ready()
        assert self._root is not None
        # None = the served weights' default, read here on the sequencer: the same weights
        # this step runs on (a swap is sequenced between steps).
        out = self._run_step(Forward(x, mask, self._root.default_causal if causal is None else bool(causal)),
                             received_ns)
        if marks is not None:
            self._mark_step(marks)
        return out

    def _mark_step(self, marks: timeline.StepMarks) -> None:
        """The step just run, as parts (service.metrics.timeline): header (the peers' step
        header), broadcast, compute and all_reduce (interleaved layer by layer: their sums),
        to_numpy (rank 0's output back to a float32 array)."""
        assert self._root is not None
        done = time.monotonic_ns()
        if self._loop_on:
            marks.mark("header", self._header_sent_ns)
        forward = timeline.wall_to_monotonic_ns(self._root.last_forward_ns)
        marks.mark("broadcast", timeline.wall_to_monotonic_ns(self._root.last_bcast_ns))
        all_reduce = self._root.last_all_reduce_ns
        if all_reduce is not None:
            marks.mark("compute", forward - all_reduce)
            marks.mark("all_reduce", forward)
        else:
            marks.mark("compute", forward)
        marks.mark("to_numpy", done)

    def _run_step(self, step: StepKind, received_ns: int = 0) -> np.ndarray:
        """Every step kind's one path (sequencer only; the kinds: service.gang.steps).

        The header first, before rank 0 converts its own input: the peers allocate their
        buffers meanwhile, so the data broadcast does not wait for them (a gang of one rank
        has no peers to tell). A poisoned output (the kind's `poisoned`) makes rank 0 ask the
        peers why (`step_error`). Any failure marks the gang BROKEN and maps to the caller's
        error: a weights-version refusal (503 weights_version_mismatch), a collective that
        ran out of time (504), a rank that failed (503 gang_broken)."""
        assert self._root is not None
        version = self.weights_version
        seq, sent_ns = 0, time.time_ns()
        try:
            if self._loop_on:
                seq = self._seq + 1
                self._send_header(step.header(seq, self._root.dtype, version, sent_ns))
                self._header_sent_ns = time.monotonic_ns()
                self._root.step_seq = seq
            out = step.root(self._root, version)
            if self._loop_on and step.poisoned(out):
                self._ask_step_errors(seq)  # maybe a rank refused the step: it says so
            if self._loop_on:
                self._record_timing(seq, received_ns or sent_ns, sent_ns)
        except (RayError, RuntimeError) as exc:
            if is_version_mismatch(exc):
                self._mark_broken(f"weights versions disagree: {first_line(cause(exc))}")
                raise GangUnavailable(
                    f"a rank did not hold the expected weights version {version} "
                    f"({first_line(cause(exc))}); no answer was computed from mixed weights; "
                    "the gang is being rebuilt with the recorded version",
                    code=ErrorCode.WEIGHTS_VERSION_MISMATCH,
                ) from exc
            # A peer died or a collective failed or timed out: the group is unusable now.
            self._mark_broken(f"collective failed in a {step.name}: {type(exc).__name__}: {first_line(exc)}")
            if is_timeout(exc):
                raise CollectiveTimeout(
                    f"a collective timed out after collective_timeout_s={self.cfg.collective_timeout_s:.1f}s "
                    "(a rank is stuck); the gang is being rebuilt"
                ) from exc
            raise GangUnavailable(
                f"a rank failed during the {step.name} ({type(exc).__name__}); the gang is being rebuilt",
                code=ErrorCode.GANG_BROKEN,
            ) from exc
        return out

    # -- the step loop's rank-0 side (sequencer thread) ------------------------------------
    def _send_header(self, header: Any) -> None:
        assert self._root is not None
        self._root.send_header(header)
        self._seq = int(header[control.SEQ])
        self._last_header = time.monotonic()

    def _ask_step_errors(self, seq: int) -> None:
        """After a poisoned output: raise the first peer's reason for refusing step `seq` (its
        WeightsVersionMismatch, or why its loop stopped)."""
        refusals = self._peers.call("step_error", seq, stage="step error", timeout_s=self._peer_answer_s)
        for refusal in refusals:
            if refusal is not None:
                raise refusal

    def _heartbeat_if_idle(self) -> None:
        """Send a heartbeat header if none went out for half of `_heartbeat_s` (sequencer only)."""
        if self._loop_on and self.state in (GangState.READY, GangState.STARTING) and (
                time.monotonic() - self._last_header >= self._heartbeat_s / 2):
            try:
                self._send_header(control.header(control.OP_HEARTBEAT, self._seq + 1, time.time_ns()))
            except RuntimeError as exc:  # a peer's connection is gone
                self._mark_broken(f"heartbeat to the step loops failed: {first_line(exc)}")

    def _queued_heartbeat(self) -> None:
        self._heartbeat_queued = False
        self._heartbeat_if_idle()

    def _start_heartbeats(self) -> None:
        """A timer thread that queues a heartbeat on the sequencer when the gang is idle;
        when the sequencer is busy, its steps are the heartbeats (and its lifecycle waits
        send them: see `_wait_heartbeating`)."""
        self._stop_heartbeats()
        stop = self._heartbeats_stop = threading.Event()
        self._heartbeat_queued = False

        def tick() -> None:
            while not stop.wait(self._heartbeat_s / 4):
                if not self._loop_on or self._heartbeat_queued:
                    continue
                if time.monotonic() - self._last_header >= self._heartbeat_s:
                    self._heartbeat_queued = True
                    try:
                        self._sequencer.submit(self._queued_heartbeat)
                    except RuntimeError:  # the sequencer is shut down
                        return

        threading.Thread(target=tick, name="gang-heartbeat", daemon=True).start()

    def _stop_heartbeats(self) -> None:
        if self._heartbeats_stop is not None:
            self._heartbeats_stop.set()
            self._heartbeats_stop = None

    def _wait_heartbeating(self, fn: Callable[[], T]) -> T:
        """On the sequencer: run fn (a lifecycle wait that may outlast the control group's
        timeout) on a helper thread, sending heartbeats meanwhile."""
        if not self._loop_on:
            return fn()
        done: Future[T] = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # re-raised on the sequencer below
                done.set_exception(exc)

        threading.Thread(target=run, name="gang-lifecycle-wait", daemon=True).start()
        # Not `except TimeoutError` around result(): fn's own timeouts (Ray's GetTimeoutError
        # is a TimeoutError) must propagate, not be taken for "still running".
        while not wait([done], timeout=self._heartbeat_s / 2).done:
            self._heartbeat_if_idle()
        return done.result()

    def _probe_step(self) -> None:
        if self.state is not GangState.READY:
            return
        try:
            self._peers.call("describe", stage="liveness probe", timeout_s=self._peer_answer_s)
        except (RayError, RuntimeError, GangServeError) as exc:
            self._mark_broken(f"liveness probe failed: {type(exc).__name__}: {first_line(exc)}")

    def _swap_weights(self, model: ModelConfig, record: Callable[[], ServedWeights]) -> ServedWeights:
        assert self._root is not None
        self._require_ready()
        # Phase 1: stage everywhere; the old weights stay in force until every rank has staged.
        calls = self._peers.submit("stage_weights", model)
        failures: list[str] = []
        root_bytes = 0
        root = self._root
        try:  # (staging never touches a group, so it may run beside the heartbeats)
            root_bytes = self._wait_heartbeating(lambda: root.stage_weights(model))
        except Exception as exc:
            failures.append(f"rank 0: {type(exc).__name__}: {first_line(exc)}")
        staged = self._peers.collect(calls, stage="stage weights", collect="settle")
        failures += staged.failures
        if failures:
            self._discard_staged()
            if self.state is GangState.BROKEN:  # a rank died meanwhile: nothing to keep serving
                raise GangUnavailable(
                    f"weights not swapped: {'; '.join(failures)}; the gang is being rebuilt with "
                    f"version {self.weights_version}", code=ErrorCode.GANG_BROKEN,
                )
            raise Conflict(
                "weights not swapped, every rank still serves version "
                f"{self.weights_version}: staging failed on {'; '.join(failures)}",
                code=ErrorCode.WEIGHTS_STAGE_FAILED,
            )
        # Phase 2: the new version is durable before any rank serves it.
        try:
            weights = self._wait_heartbeating(record)
        except Exception:
            self._discard_staged()
            raise
        # Phase 3: commit everywhere. Steps are sequenced behind this, so none can run in between.
        calls = self._peers.submit("commit_weights", weights.version)
        failures = []
        try:
            self._root.commit_weights(weights.version)
        except Exception as exc:
            failures.append(f"rank 0: {type(exc).__name__}: {first_line(exc)}")
        failures += self._peers.collect(calls, stage="commit weights", collect="settle").failures
        self.weights = weights  # the version every step now expects (and a rebuild would load)
        if failures:
            self._mark_broken(f"commit of weights version {weights.version} failed: {'; '.join(failures)}")
            raise GangUnavailable(
                f"weights version {weights.version} was recorded but its commit failed on "
                f"{'; '.join(failures)}; the gang is being rebuilt with version {weights.version}",
                code=ErrorCode.WEIGHTS_COMMIT_FAILED,
            )
        self.param_bytes_per_rank = [root_bytes, *(staged.results[r] for r in sorted(staged.results))]
        log.info("weights swapped to version %d (%s, %s)", weights.version, weights.source, weights.description)
        return weights

    def _discard_staged(self) -> None:
        assert self._root is not None
        self._root.discard_staged()
        try:
            self._peers.call("discard_staged", stage="discard staged weights")
        except PeerCallFailed as exc:
            self._mark_broken(f"a rank failed while discarding staged weights: {first_line(exc)}")

    def _arm_failpoint(self, rank: int, name: str) -> None:
        if not 0 <= rank < self.cfg.world_size:
            raise ValueError(f"rank {rank} is not in the gang (world_size {self.cfg.world_size})")
        if rank == 0:
            assert self._root is not None
            self._root.arm_failpoint(name)
        else:
            self._peers.call("arm_failpoint", name, stage="arm failpoint", ranks=[rank])

    def _record_timing(self, seq: int, received_ns: int, sent_ns: int) -> None:
        """Rank 0's timestamps of step `seq` (step_loop_stats), the last timings_kept..2x kept."""
        assert self._root is not None
        self._timings.append((seq, received_ns, sent_ns, self._root.last_bcast_ns, self._root.last_forward_ns,
                              time.time_ns()))
        if len(self._timings) > 2 * self._t.timings_kept:
            del self._timings[:self._t.timings_kept]

    def _mark_broken(self, reason: str) -> None:
        if self.state in (GangState.READY, GangState.STARTING):
            log.error("gang broken: %s", reason)
            self.state, self.reason = GangState.BROKEN, reason
            self._broken_at = time.monotonic()
            if self._on_broken is not None:
                self._on_broken()  # the supervisor starts the rebuild now, not at its next tick


class _StageClock:
    """Milliseconds per named stage, each measured from the end of the one before."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.adopted: int | None = None  # the rank the warm spare became, if any
        self.started = self._last = time.monotonic()

    def done(self, stage: str) -> None:
        now = time.monotonic()
        self.ms[stage] = round((now - self._last) * 1000, 1)
        self._last = now

