"""One process's metric values (`MetricSet`) and its hand-off to Ray's metrics (the flusher).

Each process keeps its own cumulative values in one `MetricSet` (`process_metrics()`): the
ingress its requests and shared-memory fallbacks, each GangServer its gang steps, batch
sizes, rebuilds and collective timeouts, the JobManager its epoch durations. Snapshots are
JSON-able and travel to the Controller (service.state.fleet), where
service.metrics.exposition merges them.

With `enable_ray_metrics()` (called by each Serve deployment) every observation is also
recorded through `ray.serve.metrics`, so the same figures appear, per replica, on Ray's
metrics export port as `ray_<name>` next to Serve's own `ray_serve_*` metrics. Those
records happen off the request path: a Ray metric record costs far more than our own
(the ingress's profile: bench/NOTES.md), so observations are queued and a background thread hands them to Ray every
fleet.ray_flush_interval_s, counter increments summed per series, gauges as their last value,
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
from typing import Any

from service.metrics.specs import SPECS, Spec
from service.config.tunables import FleetTunables

log = logging.getLogger("gangserve.metrics")



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
        self._t = FleetTunables()  # flush period and queue bound; set by enable_ray

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
    def enable_ray(self, tunables: FleetTunables) -> None:
        """Also record through ray.serve.metrics from now on (inside a Serve replica), flushed
        every `tunables.ray_flush_interval_s`, at most `tunables.ray_queue_max` queued."""
        with self._lock:
            if self._ray is not None:
                return
            self._ray = {}
            self._t = tunables
        threading.Thread(target=self._flush_forever, name="gangserve-ray-metrics", daemon=True).start()

    def _record_ray(self, name: str, labels: tuple[str, ...], how: str, value: float) -> None:
        """Queue one observation for Ray (the flusher records it); O(1) on the request path."""
        if len(self._ray_queue) >= self._t.ray_queue_max:
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
            time.sleep(self._t.ray_flush_interval_s)
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


def enable_ray_metrics(tunables: FleetTunables) -> None:
    _PROCESS.enable_ray(tunables)
