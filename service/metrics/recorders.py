"""What the deployments count, over their process's MetricSet: the GangServer's steps,
drops, rebuilds and gauges, and the JobManager's epoch times and job figures."""
from __future__ import annotations

import logging
from typing import Iterable

from service.metrics.process import MetricSet, process_metrics
from service.contract.gang_status import GangStatus, SessionStats
from service.contract.timing import STEP_PARTS
from service.metrics.timeline import Timeline

log = logging.getLogger("gangserve.metrics")


# ---------------------------------------------------------------- training


class EpochClock:
    """Epoch wall times from the reported history: epoch e took at(e) - at(e-1), the first
    one at(1) - the run's start. Each epoch is timed once: a resumed attempt reports again
    the epochs its checkpoint holds and redoes those after it, and only an epoch beyond every
    one timed so far is timed (against the entry reported just before it). Kept by the
    JobManager (the only reader of the runs)."""

    def __init__(self, metrics: MetricSet) -> None:
        self._metrics = metrics
        metrics.declare("gangserve_training_epoch_seconds")
        self._last: dict[str, tuple[int, float]] = {}  # job -> (epoch, at) of its last report
        self._timed: dict[str, int] = {}  # job -> the highest epoch timed

    def observe(self, job_id: str, started_at: float | None, epochs: Iterable[tuple[int, float | None]]) -> None:
        """`epochs`: the newly reported (epoch, when it ended) pairs, in report order."""
        for epoch, at in epochs:
            if at is None:
                continue
            prev_epoch, prev_at = self._last.get(job_id, (0, started_at))
            if (prev_at is not None and epoch == prev_epoch + 1 and at >= prev_at
                    and epoch > self._timed.get(job_id, 0)):
                self._metrics.observe("gangserve_training_epoch_seconds", at - prev_at)
                self._timed[job_id] = epoch
            self._last[job_id] = (epoch, float(at))

    def forget(self, job_id: str) -> None:
        self._last.pop(job_id, None)
        self._timed.pop(job_id, None)


def training_snapshot(all_statuses: Iterable[str], status_counts: dict[str, int], losses: dict[str, float],
                      epoch_metrics: MetricSet, eval_losses: dict[str, float] | None = None) -> dict[str, list]:
    """The JobManager's answer to a scrape: jobs per status (every status, zeros included),
    the last epoch's loss (and held-out loss) of each active job, and its epoch-time histogram."""
    snap = {k: v for k, v in epoch_metrics.snapshot().items() if k == "gangserve_training_epoch_seconds"}
    statuses = {s: 0 for s in all_statuses} | status_counts
    snap["gangserve_training_jobs"] = [[[s], float(n)] for s, n in sorted(statuses.items())]
    snap["gangserve_training_loss"] = [[[job], float(loss)] for job, loss in sorted(losses.items())]
    snap["gangserve_training_eval_loss"] = [[[job], float(v)] for job, v in sorted((eval_losses or {}).items())]
    for status, n in statuses.items():  # Ray's gauges (no per-job loss: Ray cannot drop a series)
        epoch_metrics.set("gangserve_training_jobs", n, (status,))
    return snap


# ---------------------------------------------------------------- the gang server


class GangServerMetrics:
    """What one GangServer replica counts; lives in the replica, so an in-place gang rebuild
    (same process, new rank actors and process group) never resets it."""

    def __init__(self, replica_id: str, metrics: MetricSet | None = None) -> None:
        self._m = metrics or process_metrics()
        self._replica = (replica_id,)
        self.in_flight = 0
        self._session_counts: dict[str, int] = {}  # the registry's counters already exported
        self._m.declare("gangserve_session_evictions", "gangserve_session_recomputed_tokens")
        self._m.declare("gangserve_gang_rebuilds", "gangserve_collective_timeouts",
                        "gangserve_gang_step_seconds", "gangserve_batch_size", "gangserve_step_padded_share",
                        "gangserve_step_part_seconds")

    def on_step(self, rows: int, seconds: float, error: BaseException | None, padded_share: float = 0.0) -> None:
        """StepBatcher's observer: one gang step finished (or failed with `error`), `padded_share`
        of its tokens padding added to batch mixed lengths. Never raises (it runs on the
        batcher's path, before the step's requests get their answers)."""
        from service.contract.errors import CollectiveTimeout

        try:
            if error is None:
                self._m.observe("gangserve_gang_step_seconds", seconds)
                self._m.observe("gangserve_batch_size", rows)
                self._m.observe("gangserve_step_padded_share", padded_share)
            elif isinstance(error, CollectiveTimeout):
                self._m.inc("gangserve_collective_timeouts")
        except Exception:  # noqa: BLE001
            log.exception("step metrics not recorded")

    def step_parts(self, step: Timeline) -> None:
        """The gang's step runner: one step's parts (service.contract.timing.STEP_PARTS, the names
        Server-Timing and GET /gang's step timings use). Never raises (it runs on the sequencer)."""
        try:
            for part, ms in step.parts_ms():
                if part in STEP_PARTS:
                    self._m.observe("gangserve_step_part_seconds", ms / 1000, (part.value,))
        except Exception:  # noqa: BLE001
            log.exception("step part metrics not recorded")

    def on_drop(self, reason: str, n: int) -> None:
        """StepBatcher's drop observer: `n` queued requests dropped uncomputed."""
        self._m.inc("gangserve_requests_dropped", ("gang", reason), float(n))

    def session_append(self, context: str, seconds: float) -> None:
        """One session append answered (service.sessions), `context`: its length bucket."""
        self._m.observe("gangserve_session_append_seconds", seconds, (context,))

    def sessions(self, stats: SessionStats) -> None:
        """Gauges and counters from service.sessions.service.SessionService.stats()."""
        self._m.set("gangserve_sessions_active", float(stats.active), self._replica)
        for row in stats.per_rank:
            for kind, value in (("used", row.used_bytes), ("capacity", row.capacity_bytes)):
                self._m.set("gangserve_session_cache_bytes", float(value), (*self._replica, str(row.rank), kind))
        for name, key, now in (("gangserve_session_evictions", "evictions", stats.evictions),
                               ("gangserve_session_recomputed_tokens", "recomputed_tokens", stats.recomputed_tokens)):
            seen = self._session_counts.get(key, 0)
            if now > seen:
                self._m.inc(name, (), float(now - seen))
                self._session_counts[key] = now

    def rebuilt(self) -> None:
        self._m.inc("gangserve_gang_rebuilds")

    def queued(self) -> "_InFlight":
        return _InFlight(self)

    def snapshot(self, info: GangStatus) -> dict[str, list]:
        """The replica's gauges from its /gang description, then everything it counted."""
        self._m.set("gangserve_gang_ready", 1.0 if info.state == "ready" else 0.0, self._replica)
        self._m.set("gangserve_weights_version", float(info.weights_version), self._replica)
        self._m.set("gangserve_queue_depth", float(self.in_flight), self._replica)
        if info.sessions:
            self.sessions(info.sessions)
        for rank in info.memory or ():  # CUDA ranks only (GET /gang's `memory`)
            labels = (*self._replica, str(rank.rank))
            self._m.set("gangserve_gpu_memory_reserved_bytes", float(rank.memory_reserved_bytes), labels)
            self._m.set("gangserve_gpu_max_memory_reserved_bytes", float(rank.max_memory_reserved_bytes), labels)
        return self._m.snapshot()


class _InFlight:
    def __init__(self, owner: GangServerMetrics) -> None:
        self._owner = owner

    def __enter__(self) -> None:
        self._owner.in_flight += 1

    def __exit__(self, *exc: object) -> None:
        self._owner.in_flight -= 1
