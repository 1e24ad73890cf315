"""The service's metrics: one definition table, kept per process, merged at scrape time.

Every metric the service exports is one `Spec` in `SPECS` (name, type, labels, buckets);
`GET /metrics` on the ingress, Ray's metrics export (through `ray.serve.metrics`) and the
Grafana dashboard's test all read that table.

Where values live:
- each process keeps its own cumulative values in one `MetricSet` (`process_metrics()`):
  the ingress its requests and shared-memory fallbacks, each GangServer its gang steps,
  batch sizes, rebuilds and collective timeouts (in the GangServer process, not in the
  Gang: an in-place rebuild keeps them), the JobManager its epoch durations;
- ingress and gang server replicas report a snapshot to the app's Controller, which keeps
  them in memory (service.state.fleet); an ingress answering `/metrics` merges its own live
  values, every other replica's latest snapshot, and the "retired" counters and histograms
  of replicas that are gone, so a service-wide counter never goes backwards when a replica
  dies or is replaced;
- gauges (gang readiness, weights version, queue depth) come only from fresh snapshots, one
  series per gang (`replica`); the JobManager's figures are asked for at scrape time.

With `enable_ray_metrics()` (called by each Serve deployment) every observation is also
recorded through `ray.serve.metrics`, so the same figures appear, per replica, on Ray's
metrics export port as `ray_<name>` next to Serve's own `ray_serve_*` metrics. Those
records happen off the request path: a Ray metric record costs far more than our own
(profiled in the ingress: ~0.5 ms of CPU per request for three records, bench/NOTES.md),
so observations are queued and a background thread hands them to Ray every
RAY_FLUSH_INTERVAL_S, counter increments summed per series, gauges as their last value,
histogram observations one by one (Ray's histogram takes no bucket counts). Ray exports
its metrics every few seconds anyway, so the delay is not visible there.
"""
from __future__ import annotations

import bisect
import collections
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Literal

log = logging.getLogger("gangserve.metrics")

Kind = Literal["counter", "histogram", "gauge"]

RAY_FLUSH_INTERVAL_S = 1.0
RAY_QUEUE_MAX = 100_000  # observations waiting for the flusher; beyond this they are dropped (counted)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
BYTES_BUCKETS = (0, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
PADDED_SHARE_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)
EPOCH_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


@dataclass(frozen=True)
class Spec:
    """One exported metric. `name` is the family name (a counter's samples add `_total`)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


SPECS: dict[str, Spec] = {s.name: s for s in (
    Spec("gangserve_requests", "counter", "HTTP requests answered by the ingress, by route template, "
         "body format and status code", ("route", "format", "code")),
    Spec("gangserve_request_seconds", "histogram", "Time from a request's arrival at the ingress to the "
         "end of its reply", ("route",), LATENCY_BUCKETS),
    Spec("gangserve_request_bytes", "histogram", "Request body bytes the ingress read", ("route",), BYTES_BUCKETS),
    Spec("gangserve_gang_step_seconds", "histogram", "Duration of one successful gang step (broadcast, "
         "tensor-parallel attention, all_reduce) in the gang server", (), LATENCY_BUCKETS),
    Spec("gangserve_batch_size", "histogram", "Batch rows per gang step (concurrent requests coalesced)",
         (), BATCH_BUCKETS),
    Spec("gangserve_step_padded_share", "histogram", "Share of a gang step's tokens that is padding added "
         "to batch requests of different seq lens (0: equal lengths)", (), PADDED_SHARE_BUCKETS),
    Spec("gangserve_queue_depth", "gauge", "Inference calls inside a gang server (queued or computing)",
         ("replica",)),
    Spec("gangserve_gang_ready", "gauge", "1 while the gang serves, else 0", ("replica",)),
    Spec("gangserve_gang_rebuilds", "counter", "Successful in-place gang rebuilds (after a rank died, "
         "hung or a collective failed)"),
    Spec("gangserve_collective_timeouts", "counter", "Gang steps that ran past collective_timeout_s"),
    Spec("gangserve_requests_dropped", "counter", "Inference requests dropped uncomputed: their deadline "
         "passed while queued (`deadline`), or their caller went away (`disconnected` at the ingress, "
         "`cancelled` in a gang server)", ("where", "reason")),
    Spec("gangserve_request_retries", "counter", "Inference attempts the ingress retried after a gang failure "
         "(by the failure's code)", ("code",)),
    Spec("gangserve_weights_version", "gauge", "The weights version a gang serves", ("replica",)),
    Spec("gangserve_shm_fallbacks", "counter", "Shared-memory hand-offs that failed and went through "
         "Ray's object store instead"),
    Spec("gangserve_training_jobs", "gauge", "Training jobs by status", ("status",)),
    Spec("gangserve_training_loss", "gauge", "Loss of the last finished epoch of an active training job",
         ("job",)),
    Spec("gangserve_training_eval_loss", "gauge", "Held-out (validation) loss of the last finished epoch of "
         "an active training job that holds samples out", ("job",)),
    Spec("gangserve_training_epoch_seconds", "histogram", "Wall time of one training epoch "
         "(including its checkpoint)", (), EPOCH_BUCKETS),
)}


def exported_names() -> set[str]:
    """Every sample name a scrape of /metrics can carry (from SPECS; counters end in _total,
    histograms have _bucket, _sum and _count), and the same with Ray's `ray_` prefix."""
    names: set[str] = set()
    for s in SPECS.values():
        if s.kind == "counter":
            own = {s.name + "_total"}
        elif s.kind == "histogram":
            own = {s.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            own = {s.name}
        names |= own | {"ray_" + n for n in own}
    return names


# ---------------------------------------------------------------- one process's values

class MetricSet:
    """Cumulative values of one process; thread-safe. Snapshots are JSON-able:
    {name: [[label values], value]} with a histogram's value {"b": per-bucket counts
    (the last is +Inf), "s": sum, "c": count}."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple[str, ...], Any]] = {}
        self._ray: dict[str, Any] | None = None
        self._ray_queue: collections.deque[tuple[str, tuple[str, ...], str, float]] = collections.deque()
        self._ray_dropped = 0

    def inc(self, name: str, labels: tuple[str, ...] = (), value: float = 1.0) -> None:
        with self._lock:
            series = self._values.setdefault(name, {})
            series[labels] = series.get(labels, 0.0) + value
        if self._ray is not None and value > 0:  # (an inc by 0 only makes the series exist)
            self._record_ray(name, labels, "inc", value)

    def set(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        with self._lock:
            self._values.setdefault(name, {})[labels] = float(value)
        if self._ray is not None:
            self._record_ray(name, labels, "set", value)

    def remove(self, name: str, labels: tuple[str, ...] = ()) -> None:
        with self._lock:
            self._values.get(name, {}).pop(labels, None)

    def observe(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        buckets = SPECS[name].buckets
        with self._lock:
            series = self._values.setdefault(name, {})
            hist = series.get(labels)
            if hist is None:
                hist = series[labels] = {"b": [0] * (len(buckets) + 1), "s": 0.0, "c": 0}
            hist["b"][bisect.bisect_left(buckets, value)] += 1  # le semantics: value <= bound
            hist["s"] += value
            hist["c"] += 1
        if self._ray is not None:
            self._record_ray(name, labels, "observe", value)

    def declare(self, *names: str) -> None:
        """Make unlabelled counters and histograms exist at 0 (exported before their first event)."""
        with self._lock:
            for name in names:
                spec, series = SPECS[name], self._values.setdefault(name, {})
                if () not in series:
                    series[()] = ({"b": [0] * (len(spec.buckets) + 1), "s": 0.0, "c": 0}
                                  if spec.kind == "histogram" else 0.0)

    def snapshot(self) -> dict[str, list]:
        with self._lock:
            return {name: [[list(labels), json.loads(json.dumps(v))] for labels, v in series.items()]
                    for name, series in self._values.items()}

    # -- Ray's metrics ---------------------------------------------------------------------
    def enable_ray(self) -> None:
        """Also record through ray.serve.metrics from now on (inside a Serve replica)."""
        with self._lock:
            if self._ray is not None:
                return
            self._ray = {}
        threading.Thread(target=self._flush_forever, name="gangserve-ray-metrics", daemon=True).start()

    def _record_ray(self, name: str, labels: tuple[str, ...], how: str, value: float) -> None:
        """Queue one observation for Ray (the flusher records it); O(1) on the request path."""
        if len(self._ray_queue) >= RAY_QUEUE_MAX:
            self._ray_dropped += 1
            return
        self._ray_queue.append((name, labels, how, value))  # deque.append is thread-safe

    def flush_ray(self) -> int:
        """Hand every queued observation to Ray: increments summed per series, gauges' last
        value, histogram observations one by one. Returns how many Ray records were made."""
        incs: dict[tuple[str, tuple[str, ...]], float] = {}
        sets: dict[tuple[str, tuple[str, ...]], float] = {}
        observations: list[tuple[str, tuple[str, ...], float]] = []
        while self._ray_queue:
            name, labels, how, value = self._ray_queue.popleft()
            if how == "inc":
                incs[(name, labels)] = incs.get((name, labels), 0.0) + value
            elif how == "set":
                sets[(name, labels)] = value
            else:
                observations.append((name, labels, value))
        records = [(n, l, "inc", v) for (n, l), v in incs.items()]
        records += [(n, l, "set", v) for (n, l), v in sets.items()]
        records += [(n, l, "observe", v) for n, l, v in observations]
        for name, labels, how, value in records:
            self._record_ray_now(name, labels, how, value)
        return len(records)

    def _flush_forever(self) -> None:
        while True:
            time.sleep(RAY_FLUSH_INTERVAL_S)
            try:
                self.flush_ray()
            except Exception as exc:  # noqa: BLE001 - the flusher must outlive any one failure
                log.debug("ray metrics flush failed: %s", exc)

    def _record_ray_now(self, name: str, labels: tuple[str, ...], how: str, value: float) -> None:
        """Best effort: Ray's metrics must never fail anything."""
        try:
            spec = SPECS[name]
            metric = self._ray.get(name) if self._ray is not None else None
            if metric is None:
                metric = _ray_metric(spec)
                self._ray[name] = metric  # type: ignore[index]
            # Serve reserves `replica` (it adds its own replica tag to every sample).
            tags = {k: v for k, v in zip(spec.labels, labels) if k != "replica"}
            getattr(metric, how)(value, tags=tags or None)
        except Exception as exc:  # noqa: BLE001
            log.debug("ray metric %s not recorded: %s", name, exc)


def _ray_metric(spec: Spec) -> Any:
    from ray.serve import metrics as serve_metrics

    tag_keys = tuple(k for k in spec.labels if k != "replica") or None
    if spec.kind == "counter":  # Ray adds the _total suffix
        return serve_metrics.Counter(spec.name, description=spec.help, tag_keys=tag_keys)
    if spec.kind == "gauge":
        return serve_metrics.Gauge(spec.name, description=spec.help, tag_keys=tag_keys)
    return serve_metrics.Histogram(spec.name, description=spec.help, boundaries=list(spec.buckets),
                                   tag_keys=tag_keys)


_PROCESS = MetricSet()


def process_metrics() -> MetricSet:
    """This process's MetricSet (one Serve replica per process)."""
    return _PROCESS


def enable_ray_metrics() -> None:
    _PROCESS.enable_ray()


# ---------------------------------------------------------------- merging and exposition

def merge(snapshots: Iterable[dict[str, list]], kinds: tuple[Kind, ...] = ("counter", "histogram", "gauge")
          ) -> dict[str, dict[tuple[str, ...], Any]]:
    """Sum snapshots series by series (only metrics of `kinds`); unknown names are skipped."""
    out: dict[str, dict[tuple[str, ...], Any]] = {}
    for snap in snapshots:
        for name, series in (snap or {}).items():
            spec = SPECS.get(name)
            if spec is None or spec.kind not in kinds:
                continue
            merged = out.setdefault(name, {})
            for labels, value in series:
                key = tuple(str(v) for v in labels)
                if spec.kind == "histogram":
                    have = merged.get(key)
                    if have is None or len(have["b"]) != len(value["b"]):
                        merged[key] = {"b": list(value["b"]), "s": value["s"], "c": value["c"]}
                    else:
                        have["b"] = [a + b for a, b in zip(have["b"], value["b"])]
                        have["s"] += value["s"]
                        have["c"] += value["c"]
                else:
                    merged[key] = merged.get(key, 0.0) + float(value)
    return out


def to_snapshot(merged: dict[str, dict[tuple[str, ...], Any]]) -> dict[str, list]:
    return {name: [[list(k), v] for k, v in series.items()] for name, series in merged.items()}


class SnapshotCollector:
    """A prometheus_client collector over values gathered (asynchronously) at scrape time."""

    def __init__(self, merged: dict[str, dict[tuple[str, ...], Any]]) -> None:
        self._merged = merged

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        for name, spec in SPECS.items():
            series = self._merged.get(name, {})
            labels = list(spec.labels)
            if spec.kind == "counter":
                family: Any = CounterMetricFamily(name, spec.help, labels=labels)
                for key, value in sorted(series.items()):
                    family.add_metric(list(key), value)
            elif spec.kind == "gauge":
                family = GaugeMetricFamily(name, spec.help, labels=labels)
                for key, value in sorted(series.items()):
                    family.add_metric(list(key), value)
            else:
                family = HistogramMetricFamily(name, spec.help, labels=labels)
                bounds = [_le(b) for b in spec.buckets] + ["+Inf"]
                for key, hist in sorted(series.items()):
                    running, buckets = 0, []
                    for bound, count in zip(bounds, hist["b"]):
                        running += count
                        buckets.append((bound, running))
                    family.add_metric(list(key), buckets, hist["s"])
            yield family


def _le(bound: float) -> str:
    return repr(float(bound))


def exposition(merged: dict[str, dict[tuple[str, ...], Any]]) -> bytes:
    """Prometheus text format (0.0.4) of `merged`."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(merged))  # type: ignore[arg-type]
    return generate_latest(registry)


# ---------------------------------------------------------------- training

class EpochClock:
    """Epoch wall times from the reported history: epoch e took at(e) - at(e-1), the first
    one at(1) - the run's start. Kept by the JobManager (the only reader of the runs)."""

    def __init__(self, metrics: MetricSet) -> None:
        self._metrics = metrics
        metrics.declare("gangserve_training_epoch_seconds")
        self._last: dict[str, tuple[int, float]] = {}  # job -> (epoch, at) of its last report

    def observe(self, job_id: str, started_at: float | None, entries: Iterable[dict[str, Any]]) -> None:
        for e in entries:
            epoch, at = int(e.get("epoch", 0)), e.get("at")
            if at is None:
                continue
            prev_epoch, prev_at = self._last.get(job_id, (0, started_at))
            # A resumed attempt re-reports from its checkpoint: only a next epoch is timed.
            if prev_at is not None and epoch == prev_epoch + 1 and at >= prev_at:
                self._metrics.observe("gangserve_training_epoch_seconds", at - prev_at)
            self._last[job_id] = (epoch, float(at))

    def forget(self, job_id: str) -> None:
        self._last.pop(job_id, None)


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
        self._m.declare("gangserve_gang_rebuilds", "gangserve_collective_timeouts",
                        "gangserve_gang_step_seconds", "gangserve_batch_size", "gangserve_step_padded_share")

    def on_step(self, rows: int, seconds: float, error: BaseException | None, padded_share: float = 0.0) -> None:
        """StepBatcher's observer: one gang step finished (or failed with `error`), `padded_share`
        of its tokens padding added to batch mixed lengths. Never raises (it runs on the
        batcher's path, before the step's requests get their answers)."""
        from service.errors import CollectiveTimeout

        try:
            if error is None:
                self._m.observe("gangserve_gang_step_seconds", seconds)
                self._m.observe("gangserve_batch_size", rows)
                self._m.observe("gangserve_step_padded_share", padded_share)
            elif isinstance(error, CollectiveTimeout):
                self._m.inc("gangserve_collective_timeouts")
        except Exception:  # noqa: BLE001
            log.exception("step metrics not recorded")

    def on_drop(self, reason: str, n: int) -> None:
        """StepBatcher's drop observer: `n` queued requests dropped uncomputed."""
        self._m.inc("gangserve_requests_dropped", ("gang", reason), float(n))

    def rebuilt(self) -> None:
        self._m.inc("gangserve_gang_rebuilds")

    def queued(self) -> "_InFlight":
        return _InFlight(self)

    def snapshot(self, info: dict[str, Any]) -> dict[str, list]:
        """The replica's gauges from its /gang description, then everything it counted."""
        self._m.set("gangserve_gang_ready", 1.0 if info.get("state") == "ready" else 0.0, self._replica)
        self._m.set("gangserve_weights_version", float(info.get("weights_version") or 0), self._replica)
        self._m.set("gangserve_queue_depth", float(self.in_flight), self._replica)
        return self._m.snapshot()


class _InFlight:
    def __init__(self, owner: GangServerMetrics) -> None:
        self._owner = owner

    def __enter__(self) -> None:
        self._owner.in_flight += 1

    def __exit__(self, *exc: object) -> None:
        self._owner.in_flight -= 1
