"""The gang's step runner: the sequencer, the step loop's headers and heartbeats, every step.

Sequencer: every operation that touches the ranks (bring-up, a step, a weights swap, a
liveness probe, a heartbeat, teardown) runs on ONE thread (service.gang.sequencer), which
this runner owns. Rank 0 sends the peers' step headers and lifecycle calls and then runs its
own side; the peers take both in the order sent, so all ranks see one global sequence of
collectives and concurrent requests cannot deadlock.

Steps (protocol in service.gang.control, the kinds' one table in service.gang.steps): after
bring-up the peers block reading a small header from rank 0 on the gang's header link (one
TCP connection per peer, service.gang.header_link); a step is one header (`step.kind.header(...)`), never a Ray call (a gang of one
rank has no peers to tell). The header goes out before rank 0 prepares its own input (a late
follower stalls the first collective). A heartbeat header goes out whenever no header went
out for a quarter of `collective_timeout_s`, also while the sequencer waits on lifecycle Ray
calls (`wait_heartbeating`: staging weights can take longer than the group timeout). A peer
refusing a step for its weights version records why before the all_reduce; rank 0, seeing
the poisoned output, asks it over Ray (`step_error`).

Timings: every step is marked on a timeline (service.metrics.timeline, the parts of
service.contract.timing.STEP_PARTS): the batcher's when requests are being timed (Server-
Timing), else one of its own. The runner keeps the recent steps' timelines (GET /gang's
`step_timings`, with the peers' wake-up stamps) and tells `on_parts` of each (the metrics).
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import threading
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np
from ray.exceptions import RayError

from service.config.builder_args import GangConfig
from service.config.tunables import GangTunables
from service.contract.errors import CollectiveTimeout, ErrorCode, GangUnavailable, gang_state_code
from service.contract.gang_status import GangState
from service.contract.timing import STEP_PARTS, Part, StepTimings
from service.gang import control
from service.gang.failures import cause, first_line, is_timeout, is_version_mismatch
from service.gang.peers import PeerGroup
from service.gang.rank import RankWorker
from service.gang.sequencer import Sequencer
from service.gang.steps import Step
from service.metrics import timeline
from service.metrics.timeline import Timeline

log = logging.getLogger("gangserve.gang")
T = TypeVar("T")


class Health:
    """The gang's state and why: one owner, read and marked by every part of the gang."""

    def __init__(self, on_broken: Callable[[], None] | None = None) -> None:
        self.state = GangState.STARTING
        self.reason = "starting"
        self.broken_at: float | None = None  # when the gang last turned BROKEN (rebuild timings)
        self._on_broken = on_broken  # told (from any thread) when the gang turns BROKEN

    def set(self, state: GangState, reason: str) -> None:
        self.state, self.reason = state, reason

    def explain(self, reason: str) -> None:
        """A new reason for the same state (the supervisor's rebuild attempts)."""
        self.reason = reason

    def mark_broken(self, reason: str) -> None:
        if self.state in (GangState.READY, GangState.STARTING):
            log.error("gang broken: %s", reason)
            self.state, self.reason = GangState.BROKEN, reason
            self.broken_at = time.monotonic()
            if self._on_broken is not None:
                self._on_broken()  # the supervisor starts the rebuild now, not at its next tick

    def require_ready(self) -> None:
        if self.state is not GangState.READY:
            raise GangUnavailable(f"gang is {self.state.value}: {self.reason}",
                                  code=gang_state_code(self.state.value))


@dataclass
class Members:
    """The current generation's ranks: rank 0 (in this process) and the peers' actors. Written by
    the lifecycle (bring-up, teardown) on the sequencer; read by the runner and the swap."""

    root: RankWorker | None = None
    peers: PeerGroup | None = None

    def require_root(self) -> RankWorker:
        if self.root is None:
            raise GangUnavailable("the gang has no rank 0 (it is not brought up)", code=ErrorCode.GANG_BROKEN)
        return self.root


@dataclass(frozen=True)
class StepRecord:
    """One step as rank 0 saw it: its header's sequence number and wall-clock send time (the
    peers' wake-ups are measured from it), and its timeline."""

    seq: int
    sent_ns: int
    timeline: Timeline


class StepRunner:
    """Runs every operation on the sequencer; sends the headers and heartbeats; runs the steps."""

    def __init__(self, health: Health, members: Members, cfg: GangConfig, tunables: GangTunables,
                 on_parts: Callable[[Timeline], None] | None = None) -> None:
        self._health = health
        self._members = members
        self._cfg = cfg
        self._t = tunables
        self._on_parts = on_parts  # told of every step's timeline (the metrics), on the sequencer
        self.heartbeat_s = tunables.heartbeat_interval(cfg.collective_timeout_s)
        self._peer_answer_s = min(tunables.peer_answer_timeout_s, cfg.collective_timeout_s)
        # Step loop state (sequencer thread only, except the heartbeat timer's reads).
        self.loop_on = False  # the peers' loops run (every bring-up with peers starts them)
        self._seq = 0  # last header sequence number sent
        self._last_header = time.monotonic()
        self._heartbeat_queued = False
        self._heartbeats_stop: threading.Event | None = None  # set to end this generation's timer
        self._records: deque[StepRecord] = deque(maxlen=tunables.timings_kept)
        # One thread = one global order of collectives (service.gang.sequencer).
        self._sequencer = Sequencer(on_stuck=health.mark_broken)

    # -- the sequencer ------------------------------------------------------------------
    async def run(self, fn: Callable[..., T], *args: Any, step_timeout_s: float | None = None,
                  request_deadline: float | None = None) -> T:
        """fn(*args) on the sequencer (service.gang.sequencer.Sequencer.run)."""
        return await self._sequencer.run(fn, *args, step_timeout_s=step_timeout_s, request_deadline=request_deadline)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._sequencer.submit(fn, *args)

    def shutdown(self) -> None:
        self.stop_loop()
        self._sequencer.shutdown()

    # -- the step loop's generation -------------------------------------------------------
    def start_loop(self) -> None:
        """Bring-up, after the peers' loops started: headers from now on, heartbeats with them."""
        self.loop_on, self._seq, self._last_header = True, 0, time.monotonic()
        self._records.clear()
        self._start_heartbeats()

    def stop_loop(self) -> None:
        """Teardown: no more headers (the group is going), no more heartbeats."""
        self.loop_on = False
        if self._heartbeats_stop is not None:
            self._heartbeats_stop.set()
            self._heartbeats_stop = None

    # -- steps (sequencer only) ------------------------------------------------------------
    def run_step(self, step: Step, version: int, marks: Timeline | None = None) -> np.ndarray:
        """Every step kind's one path (sequencer only).

        The header first, before rank 0 converts its own input: the peers allocate their
        buffers meanwhile, so the data broadcast does not wait for them. A poisoned output (the
        kind's `poisoned`) makes rank 0 ask the peers why (`step_error`). `marks`: the timeline
        the step's parts go on (the batcher's; None: one of the runner's own). Any failure marks
        the gang BROKEN and maps to the caller's error: a weights-version refusal (503
        weights_version_mismatch), a collective that ran out of time (504), a rank that failed
        (503 gang_broken)."""
        root = self._members.require_root()
        marks = marks if marks is not None else Timeline.starting_now()
        seq, sent_ns = 0, time.time_ns()
        try:
            if self.loop_on:
                seq = self._seq + 1
                self._send_header(step.kind.header(seq, root.dtype, version, sent_ns, step.fields()))
                marks.mark(Part.HEADER)
                root.step_seq = seq
            out = step.root(root, version)
            if self.loop_on and step.poisoned(out):
                self._ask_step_errors(seq)  # maybe a rank refused the step: it says so
        except (RayError, RuntimeError) as exc:
            raise self._failed(step, version, exc) from exc
        self._mark_parts(root, marks)
        if self.loop_on:
            self._records.append(StepRecord(seq, sent_ns, marks))
        if self._on_parts is not None:
            self._on_parts(marks)
        return out

    def _failed(self, step: Step, version: int, exc: BaseException) -> Exception:
        """A step's failure: the gang marked BROKEN, and the caller's error."""
        if is_version_mismatch(exc):
            self._health.mark_broken(f"weights versions disagree: {first_line(cause(exc))}")
            return GangUnavailable(
                f"a rank did not hold the expected weights version {version} "
                f"({first_line(cause(exc))}); no answer was computed from mixed weights; "
                "the gang is being rebuilt with the recorded version",
                code=ErrorCode.WEIGHTS_VERSION_MISMATCH,
            )
        # A peer died or a collective failed or timed out: the group is unusable now.
        name = step.kind.name
        self._health.mark_broken(f"collective failed in a {name}: {type(exc).__name__}: {first_line(exc)}")
        if is_timeout(exc):
            return CollectiveTimeout(
                f"a collective timed out after collective_timeout_s={self._cfg.collective_timeout_s:.1f}s "
                "(a rank is stuck); the gang is being rebuilt")
        return GangUnavailable(f"a rank failed during the {name} ({type(exc).__name__}); the gang is being rebuilt",
                               code=ErrorCode.GANG_BROKEN)

    @staticmethod
    def _mark_parts(root: RankWorker, marks: Timeline) -> None:
        """The step just run, as parts: broadcast, compute and all_reduce (interleaved layer by
        layer: their sums), to_numpy (rank 0's output back to a float32 array); the header's
        was marked when it went out. At world size 1 (no peer) `broadcast` is the input made a
        tensor, and there is no all_reduce."""
        done = time.monotonic_ns()
        if root.world_size == 1:  # the shortest path: no broadcast, no step clock, two host stamps
            marks.mark(Part.BROADCAST, root.alone_ns[0])  # the input as a tensor on the device
            marks.mark(Part.COMPUTE, root.alone_ns[1])
            marks.mark(Part.TO_NUMPY, done)
            return
        forward = timeline.wall_to_monotonic_ns(root.last_forward_ns)
        marks.mark(Part.BROADCAST, timeline.wall_to_monotonic_ns(root.last_bcast_ns))
        all_reduce = root.last_all_reduce_ns
        if all_reduce is not None:
            marks.mark(Part.COMPUTE, forward - all_reduce)
            marks.mark(Part.ALL_REDUCE, forward)
        else:
            marks.mark(Part.COMPUTE, forward)
        marks.mark(Part.TO_NUMPY, done)

    def _send_header(self, header: control.Header) -> None:
        self._members.require_root().send_header(header)
        self._seq = header.seq
        self._last_header = time.monotonic()

    def _ask_step_errors(self, seq: int) -> None:
        """After a poisoned output: raise the first peer's reason for refusing step `seq` (its
        WeightsVersionMismatch, or why its loop stopped)."""
        assert self._members.peers is not None
        refusals = self._members.peers.call("step_error", seq, stage="step error", timeout_s=self._peer_answer_s)
        for refusal in refusals:
            if refusal is not None:
                raise refusal

    # -- heartbeats ---------------------------------------------------------------------
    def heartbeat_if_idle(self) -> None:
        """Send a heartbeat header if none went out for half of `heartbeat_s` (sequencer only)."""
        if self.loop_on and self._health.state in (GangState.READY, GangState.STARTING) and (
                time.monotonic() - self._last_header >= self.heartbeat_s / 2):
            try:
                self._send_header(control.loop_header(control.OP_HEARTBEAT, self._seq + 1, time.time_ns()))
            except RuntimeError as exc:  # a peer's connection is gone
                self._health.mark_broken(f"heartbeat to the step loops failed: {first_line(exc)}")

    def _queued_heartbeat(self) -> None:
        self._heartbeat_queued = False
        self.heartbeat_if_idle()

    def _start_heartbeats(self) -> None:
        """A timer thread that queues a heartbeat on the sequencer when the gang is idle;
        when the sequencer is busy, its steps are the heartbeats (and its lifecycle waits
        send them: see `wait_heartbeating`)."""
        if self._heartbeats_stop is not None:
            self._heartbeats_stop.set()
        stop = self._heartbeats_stop = threading.Event()
        self._heartbeat_queued = False

        def tick() -> None:
            while not stop.wait(self.heartbeat_s / 4):
                if not self.loop_on or self._heartbeat_queued:
                    continue
                if time.monotonic() - self._last_header >= self.heartbeat_s:
                    self._heartbeat_queued = True
                    try:
                        self._sequencer.submit(self._queued_heartbeat)
                    except RuntimeError:  # the sequencer is shut down
                        return

        threading.Thread(target=tick, name="gang-heartbeat", daemon=True).start()

    def wait_heartbeating(self, fn: Callable[[], T]) -> T:
        """On the sequencer: run fn (a lifecycle wait that may outlast the control group's
        timeout) on a helper thread, sending heartbeats meanwhile."""
        if not self.loop_on:
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
        while not wait([done], timeout=self.heartbeat_s / 2).done:
            self.heartbeat_if_idle()
        return done.result()

    # -- timings (GET /gang) ----------------------------------------------------------------
    async def loop_stats(self, window: int = 32) -> StepTimings:
        """Where the last `window` steps' time went (medians, ms): rank 0's step parts from their
        timelines, and from every peer's stamps `peer_wake_ms` (header sent -> each peer awake:
        the control cost) and `skew_ms` (the latest peer's wake-up minus the header's send: how
        late the first collective starts). Wall clocks: across nodes, skew includes their offset."""
        peers_group = self._members.peers
        if not self.loop_on or peers_group is None:
            return StepTimings(enabled=False)
        mine = {r.seq: r for r in list(self._records)[-window:]}
        try:  # off the sequencer (a stats read never waits behind a step): no heartbeats from here
            peers = await asyncio.to_thread(peers_group.call, "loop_timings", stage="step timings",
                                            timeout_s=self._t.stats_timeout_s, tick=False)
        except Exception as exc:  # a stats read must never fail /gang
            return StepTimings(enabled=True, error=f"{type(exc).__name__}: {first_line(exc)}")
        woke = [{t[0]: t[2] for t in p} for p in peers]  # per peer: seq -> woke ns (Rank.loop_timings)
        seqs = [s for s in mine if all(s in w for w in woke)]
        if not seqs:
            return StepTimings(enabled=True, heartbeat_s=self.heartbeat_s)

        def med(values: list[float]) -> float:
            return round(statistics.median(values) / 1e6, 3)

        wake = [[w[s] - mine[s].sent_ns for s in seqs] for w in woke]
        parts: dict[Part, list[float]] = {}
        for s in seqs:
            for part, ms in mine[s].timeline.parts_ms():
                if part in STEP_PARTS:
                    parts.setdefault(part, []).append(ms * 1e6)
        return StepTimings(
            enabled=True, steps=len(seqs), heartbeat_s=self.heartbeat_s,
            parts_ms={part: med(parts[part]) for part in STEP_PARTS if part in parts},
            peer_wake_ms=[med(w) for w in wake],
            skew_ms=med([max(w[i] for w in wake) for i in range(len(seqs))]),
        )
