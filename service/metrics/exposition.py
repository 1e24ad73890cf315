"""Merging snapshots and the Prometheus text: what `GET /metrics` answers.

An ingress answering `/metrics` merges its own live values, every other replica's latest
snapshot (kept by the Controller, service.state.fleet) and the "retired" counters and
histograms of replicas that are gone, so a service-wide counter never goes backwards when a
replica dies or is replaced; gauges come only from fresh snapshots, one series per gang
(`replica`); the JobManager's figures are asked for at scrape time.
"""
from __future__ import annotations

from typing import Any, Iterable

from service.metrics.specs import SPECS, Kind


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
