"""The gang's lifecycle: bring-up, rebuild, teardown (all on the step runner's sequencer).

Rank 0 is a `RankWorker` living in the calling process (the GangServer replica); ranks
1..N-1 are Ray actors pinned to bundles 1..N-1 of the replica's placement group (Serve
reserves all bundles at once, so the gang is placed all-or-nothing).

Bring-up runs in named stages, each bounded: create -> rendezvous -> load -> (compile, with
sessions) -> start_loop (world size > 1) -> warmup; `last_bring_up` reports each stage's
milliseconds. A failed stage tears down what was made and leaves the gang BROKEN.

Rebuild: kill the peers, leave the group and bring the gang up again in the same bundles
(new group, new pids), serving the recorded weights; a warm spare (service.gang.spare) may
become one of the new peers. Lifecycle calls to the peers are Ray calls, bounded by
`stage_timeout_s` (service.gang.peers), and send heartbeats while they wait.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.cluster.placement import GangUnschedulable, check_feasible, cluster_snapshot, gang_request, waiting_reason
from service.config.builder_args import GangConfig, ModelConfig
from service.config.tunables import GangTunables, StateTunables
from service.contract.errors import GangServeError, GangStartupError
from service.contract.gang_status import GangState
from service.gang.failures import first_line
from service.gang.peers import Calls, PeerGroup
from service.gang.rank import RankInfo, RankWorker
from service.gang.runner import Health, Members, StepRunner
from service.gang.spare import WarmSpare
from service.gang.steps import Forward
from service.parallel.paged_kernel import KernelShape, KernelStatus
from service.weights.served import ServedWeights

log = logging.getLogger("gangserve.gang")

RankActor = ray.remote(max_restarts=0, max_task_retries=0)(RankWorker)


@dataclass(frozen=True)
class SessionPool:
    """The sessions' KV pool every rank holds (service.sessions.service.pool_of): its pages."""

    num_blocks: int
    block_size: int


class Lifecycle:
    """Brings the ranks up, rebuilds and tears them down; owns who they are and what they hold."""

    def __init__(self, health: Health, members: Members, runner: StepRunner, model: ModelConfig, gang: GangConfig,
                 placement_group: PlacementGroup | None, tunables: GangTunables, state_tunables: StateTunables,
                 sessions: SessionPool | None) -> None:
        self._health = health
        self._members = members
        self._runner = runner
        self._t = tunables
        self._state_t = state_tunables
        self.declared_model = model  # the builder's model args; each version's checkpoint overrides theirs
        self.cfg = gang
        self.placement_group = placement_group
        self._session_pool = sessions if sessions is not None and sessions.num_blocks > 0 else None
        # Which attention the session steps use, and why (the bring-up's `compile` stage; GET /gang).
        self.session_attention = KernelStatus("gather", "sessions are off (no KV pool)" if self._session_pool is None
                                              else "not brought up yet")
        self.backend = "unknown"
        self.weights: ServedWeights | None = None  # the version every rank holds (None: none yet)
        self.generation = 0  # bumps on every successful bring-up
        self.rank_infos: list[RankInfo] = []
        self.param_bytes_per_rank: list[int] = []
        # The last (re)build's stages, ms (GET /gang `last_bring_up`): where a rebuild's time goes.
        self.last_bring_up: dict[str, Any] = {}
        # An idle rank process, adopted by a rebuild (service.gang.spare).
        self.spare = WarmSpare(gang, placement_group, RankActor, tunables, state_tunables)
        # What the spare compiles before it counts as warm: the peers' in-place attention (None:
        # they gather), and how long it may compile (the bring-up's own budget).
        self._spare_kernel: KernelShape | None = None
        self._compile_budget_s = min(tunables.session_compile_budget_s, gang.stage_timeout_s / 2)
        members.peers = self._new_peers([])

    @property
    def weights_version(self) -> int:
        return self.weights.version if self.weights else 0

    def serve(self, weights: ServedWeights, param_bytes_per_rank: list[int]) -> None:
        """Every rank now holds `weights` (a bring-up's load, a swap's commit)."""
        self.weights, self.param_bytes_per_rank = weights, param_bytes_per_rank

    # -- sequencer only --------------------------------------------------------------------
    def bring_up(self, weights: ServedWeights, prior: dict[str, float] | None = None) -> None:
        """Bring every rank up serving `weights`; `prior`: stage timings already spent
        (the rebuild's teardown), reported with this bring-up's in `last_bring_up`."""
        started = time.monotonic()
        stages = _StageClock()
        try:
            self._stages(weights, stages)
        except Exception as exc:
            self.teardown()
            self._health.set(GangState.BROKEN, f"bring-up failed: {exc}")
            raise
        self.generation += 1
        self._health.set(GangState.READY, "ready")
        self.last_bring_up = {"ms": {**(prior or {}), **stages.ms}, "spare_adopted_as_rank": stages.adopted}
        self.spare.start(self._spare_kernel, self._compile_budget_s)  # after READY: never delays serving
        log.info(
            "gang ready (generation %d): world_size=%d backend=%s in %.1fs (stages, ms: %s); weights version %d "
            "(%s, %s); pids %s", self.generation, self.cfg.world_size, self.backend, time.monotonic() - started,
            self.last_bring_up, weights.version, weights.source, weights.description, [i.pid for i in self.rank_infos],
        )

    def _stages(self, weights: ServedWeights, stages: "_StageClock") -> None:
        cfg, ws = self.cfg, self.cfg.world_size
        model = weights.model_config(self.declared_model)
        # Stage 1: create. Rank 0 is this process; peers go to bundles 1..N-1, one of
        # them the warm spare when it is warm and on that rank's node.
        root = self._members.root = RankWorker(0, ws, use_gpu=cfg.use_gpu, torch_threads=cfg.threads_per_rank,
                                               allow_tf32=cfg.allow_tf32, tunables=self._t,
                                               state_tunables=self._state_t)
        previous_nodes = {info.rank: info.node_id for info in self.rank_infos}  # bundles stay put
        peers = self._members.peers = self._new_peers([])  # filled as they start: a teardown kills any
        refs = []
        for rank in range(1, ws):  # each rank its own first call: the spare's adopt, a new one's describe
            spare = self.spare.take(previous_nodes.get(rank))
            if spare is not None:
                peers.actors.append(spare)
                refs.append(spare.adopt.remote(rank))
                stages.adopted = rank
            else:
                peers.actors.append(self._spawn_actor(rank))
                refs.append(peers.actors[-1].describe.remote())
        # A late `create` is most likely an unplaced bundle (e.g. a node was lost): needed vs free.
        peer_infos = peers.collect(Calls(list(range(1, ws)), refs), stage="create", diagnose=self._placement_diagnosis)
        self.rank_infos = [root.describe(), *peer_infos]
        self.backend = self._choose_backend(self.rank_infos)
        stages.done("create")

        # Stage 2: rendezvous at rank 0's node IP and an OS-chosen port.
        port = root.open_store(cfg.collective_timeout_s) if ws > 1 else 0
        host = root.info.node_ip
        calls = peers.submit("rendezvous", host, port, self.backend, cfg.collective_timeout_s)
        root.rendezvous(host, port, self.backend, cfg.collective_timeout_s)
        peers.collect(calls, stage="rendezvous")
        stages.done("rendezvous")

        # Stage 3: load. Each rank reads only its own slice of the recorded version.
        calls = peers.submit("load_weights", model, weights.version)
        root_bytes = root.load_weights(model, weights.version)
        self.serve(weights, [root_bytes, *peers.collect(calls, stage="load")])
        stages.done("load")

        # Stage 3b: compile (sessions). Each rank alone, no collective: allocate its KV pool
        # and build (or load) and check the in-place attention, so no user's append waits for it.
        if self._session_pool is not None:
            self._warm_sessions(self._session_pool)
            stages.done("compile")

        # Stage 4: the peers' step loops (from here on a peer's wait is bounded by the
        # control group's timeout, so heartbeats start with them).
        if ws > 1:
            peers.call("start_loop", stage="start step loop")
            self._runner.start_loop()
            stages.done("start_loop")

        # Stage 5: warmup. One tiny request proves every collective path works.
        self._runner.run_step(Forward(np.zeros((1, 1, model.embed_dim), dtype=np.float32),
                                      causal=root.default_causal), self.weights_version)
        stages.done("warmup")

    def _warm_sessions(self, pool: SessionPool) -> None:
        """Every rank's `warm_sessions` at once (bounded by stage_timeout_s; each rank's compiling
        by tunables.gang.session_compile_budget_s), and one log line saying which path runs."""
        root, peers = self._members.require_root(), self._members.peers
        assert peers is not None
        args = (pool.num_blocks, pool.block_size, self._t.session_attention, self._compile_budget_s)
        calls = peers.submit("warm_sessions", *args)
        ranks = [root.warm_sessions(*args), *peers.collect(calls, stage="compile")]
        paths = {r.path for r in ranks}
        path = paths.pop() if len(paths) == 1 else "mixed"
        first = next((r for r in ranks if not r.in_place), ranks[0])
        self.session_attention = KernelStatus(path, first.reason, max(r.compile_s for r in ranks),
                                              min(r.shapes for r in ranks))
        self._spare_kernel = root.kernel_shape if path == "in_place" else None
        if self.session_attention.in_place:
            log.info("session attention: %s over the KV pool's blocks on every rank (%s; %.1f s at most per rank "
                     "to build or load and check)", path, first.reason, self.session_attention.compile_s)
        else:
            # Asked for by the setting, it is the service's choice, not a fault worth a warning.
            level = logging.INFO if self._t.session_attention == "gather" else logging.WARNING
            log.log(level, "session attention: the gather path (%s) on ranks %s: %s", path,
                    [i for i, r in enumerate(ranks) if not r.in_place], first.reason)

    def rebuild(self, weights: ServedWeights) -> None:
        stages = _StageClock()
        if self._health.broken_at is not None:  # detection -> the supervisor's decision -> this thread
            stages.ms["broken_to_rebuild"] = round((stages.started - self._health.broken_at) * 1000, 1)
            self._health.broken_at = None
        self.teardown()
        stages.done("teardown")
        self.bring_up(weights, prior=stages.ms)

    def teardown(self) -> None:
        self._runner.stop_loop()  # no more headers: the group is going
        if self._members.peers is not None:
            self._members.peers.kill()
        self._members.peers = self._new_peers([])
        if self._members.root is not None:
            try:
                self._members.root.close()
            except Exception:  # the group may be broken; we are leaving it anyway
                log.exception("closing rank 0's process group failed")
            self._members.root = None

    def probe(self) -> None:
        """Ask every peer for a sign of life; a dead or stopped one marks the gang BROKEN."""
        if self._health.state is not GangState.READY or self._members.peers is None:
            return
        try:
            self._members.peers.call("describe", stage="liveness probe",
                                     timeout_s=min(self._t.peer_answer_timeout_s, self.cfg.collective_timeout_s))
        except (RayError, RuntimeError, GangServeError) as exc:
            self._health.mark_broken(f"liveness probe failed: {type(exc).__name__}: {first_line(exc)}")

    def arm_failpoint(self, rank: int, name: str) -> None:
        if not 0 <= rank < self.cfg.world_size:
            raise ValueError(f"rank {rank} is not in the gang (world_size {self.cfg.world_size})")
        if rank == 0:
            self._members.require_root().arm_failpoint(name)
        else:
            assert self._members.peers is not None
            self._members.peers.call("arm_failpoint", name, stage="arm failpoint", ranks=[rank])

    # -- helpers -------------------------------------------------------------------------
    def _new_peers(self, actors: list[Any]) -> PeerGroup:
        """A generation's peers: waits bounded by stage_timeout_s, heartbeats sent while
        the sequencer waits, a dead peer marks this generation BROKEN."""
        return PeerGroup(actors, self.cfg.stage_timeout_s, on_died=self._peer_died,
                         on_wait=self._runner.heartbeat_if_idle, wait_slice_s=self._runner.heartbeat_s / 2)

    def _peer_died(self, group: PeerGroup, rank: int, stage: str) -> None:
        if group is self._members.peers:  # a call to an earlier generation's peers breaks nothing now
            self._health.mark_broken(f"rank {rank} died during {stage}")

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
