"""The live view of an app's gangs and of its replicas' metrics: in memory, one owner.

Which gangs exist and how they are, and what each replica has counted, are ephemeral
facts: they are true now and worthless after a restart. They live here, in the memory of
the app's one `Controller` replica (service.deployments.controller), the way Ray Serve's
own controller owns its view of the fleet; nothing writes them to a database.

Who tells the fleet what:
- every GangServer replica *reports* its `/gang` description (and its metric snapshot)
  at once on every state change and every `tunables.report_interval_s`;
- the controller *watches* every gang it has heard from (service.deployments.controller):
  a replica whose process died is `lost` at once, before Serve notices, so `/readyz`
  never counts a dead gang;
- every ingress replica reports its metric snapshot and reads the view.

Every change a request path acts on (a gang's state, generation, weights version, rank
placement or data channel; a gang lost, withdrawn, unreachable or reachable again) bumps
`version`: the controller's long poll (`Controller.watch_fleet`) answers each ingress
replica as soon as it moves, so the request path reads a pushed view instead of polling
every gang.

A gang counts as serving only while its last report said `ready`, is fresher than
`tunables.stale_after_s` and its process is not known to be dead. A replica's counters outlive it:
when it is lost, withdrawn or silent for `tunables.fold_after_s`, its counters and histograms are
folded into one `retired` snapshot, so a service-wide counter never goes backwards while
the controller lives (a controller restart resets them, which Prometheus reads as a
counter reset).

Pure Python, no Ray: every method takes the time it acts at, so tests drive the clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.contract.errors import gang_state_code
from service.contract.gang_status import FleetView, GangRow, GangState, GangStatus, LostGangStatus, ObservedState
from service.metrics.exposition import merge, to_snapshot
from service.config.tunables import FleetTunables

# The reporting periods and ages (service.config.tunables says why each value).


@dataclass
class GangReport:
    """One gang's latest report, as the fleet holds it."""

    replica_id: str
    info: GangStatus  # validated when reported: a malformed report is refused, never shown
    reported_at: float
    unreachable_since: float | None = None  # the controller's pings fail (node cut off)


@dataclass
class LostGang:
    replica_id: str
    reason: str
    at: float


@dataclass
class Fleet:
    """The gangs and metric snapshots of one app. Not thread-safe: one event loop owns it."""

    tunables: FleetTunables = field(default_factory=FleetTunables)  # staleness, folding, lost-kept times
    gangs: dict[str, GangReport] = field(default_factory=dict)
    lost: dict[str, LostGang] = field(default_factory=dict)
    _metrics: dict[str, tuple[float, dict[str, list]]] = field(default_factory=dict)  # source -> (at, snapshot)
    _retired: dict[str, list] = field(default_factory=dict)
    version: int = 0  # bumped on every change a request path acts on (see the module docstring)

    # -- gangs ------------------------------------------------------------------------------
    def report(self, status: GangStatus, now: float, metrics: dict[str, list] | None = None) -> None:
        """A gang's report (its /gang description) and its metric snapshot, as of `now`, under
        the replica id the report names. The report is a GangStatus, checked where it was
        built (service.gang.gang.Gang.describe)."""
        replica_id = status.replica_id
        if replica_id in self.lost:
            return  # a late report from a process already seen dead never revives it
        previous = self.gangs.get(replica_id)
        if (previous is None or previous.unreachable_since is not None or now - previous.reported_at > self.tunables.stale_after_s
                or _routing_key(previous.info) != _routing_key(status)):
            self.version += 1
        self.gangs[replica_id] = GangReport(replica_id, status, now)  # a report: it reached us
        if metrics is not None:
            self.report_metrics(gang_source(replica_id), metrics, now)

    def mark_lost(self, replica_id: str, reason: str, now: float) -> None:
        """The gang's process is gone (the controller saw it die): not counted from now on."""
        self.gangs.pop(replica_id, None)
        self.lost[replica_id] = LostGang(replica_id, reason, now)
        self.version += 1
        self._retire(gang_source(replica_id))

    def mark_unreachable(self, replica_id: str, now: float) -> None:
        gang = self.gangs.get(replica_id)
        if gang is not None and gang.unreachable_since is None:
            gang.unreachable_since = now
            self.version += 1

    def mark_reachable(self, replica_id: str) -> None:
        gang = self.gangs.get(replica_id)
        if gang is not None and gang.unreachable_since is not None:
            gang.unreachable_since = None
            self.version += 1

    def withdraw(self, replica_id: str) -> None:
        """A gang shut down gracefully (scale-down, redeploy): forget it, keep its counters."""
        if self.gangs.pop(replica_id, None) is not None:
            self.version += 1
        self._retire(gang_source(replica_id))

    def serving(self, gang: GangReport, now: float) -> bool:
        return (gang.info.state is GangState.READY and now - gang.reported_at <= self.tunables.stale_after_s
                and gang.unreachable_since is None)

    def next_stale_s(self, now: float) -> float:
        """Seconds until the first gang now counted as serving stops being (its report turns
        stale); infinity when none will."""
        ends = [g.reported_at + self.tunables.stale_after_s for g in self.gangs.values() if self.serving(g, now)]
        return max(0.0, min(ends) - now) + 0.01 if ends else float("inf")

    def view(self, now: float, controller_up_s: float | None = None) -> FleetView:
        """The latest report of each live gang as a row of the view (service.contract.gang_status.GangRow:
        the report with its age), how many serve now, and the gangs lost recently (newest
        first), at this `version`.

        A gang that is not serving although its last report said ready (stale, or the
        controller cannot reach it) is shown with the state it is really in."""
        self._forget_old(now)
        rows = []
        for rid in sorted(self.gangs):
            gang = self.gangs[rid]
            why_unreachable = None
            if gang.info.state is GangState.READY and not self.serving(gang, now):
                why_unreachable = (
                    f"the controller cannot reach this gang's replica for {now - gang.unreachable_since:.1f}s"
                    if gang.unreachable_since is not None else
                    f"no report for {now - gang.reported_at:.1f}s (a gang reports every {self.tunables.report_interval_s:g}s)")
            rows.append(GangRow.of(gang.info, reported_s_ago=round(now - gang.reported_at, 1),
                                   unreachable_because=why_unreachable,
                                   code=gang_state_code(ObservedState.UNREACHABLE)))
        lost = [LostGangStatus(replica_id=g.replica_id, reason=g.reason, s_ago=round(now - g.at, 1))
                for g in sorted(self.lost.values(), key=lambda g: -g.at)]
        return FleetView(gangs=rows, ready=sum(1 for r in rows if r.state is GangState.READY), lost=lost,
                         controller_up_s=controller_up_s, version=self.version)

    def _forget_old(self, now: float) -> None:
        for rid in [r for r, g in self.lost.items() if now - g.at > self.tunables.lost_kept_s]:
            del self.lost[rid]
        for rid in [r for r, g in self.gangs.items() if now - g.reported_at > self.tunables.fold_after_s]:
            self.withdraw(rid)  # silent far longer than any health check: it is gone

    # -- metrics ----------------------------------------------------------------------------
    def report_metrics(self, source: str, snapshot: dict[str, list], now: float) -> None:
        """A replica's cumulative metric snapshot (`source`: 'ingress:<id>' or 'gang:<id>')."""
        self._metrics[source] = (now, snapshot)

    def metrics(self, now: float, exclude: str | None = None) -> list[dict[str, list]]:
        """Snapshots to merge for a scrape: every fresh replica's (gauges included), the
        counters and histograms of stale ones, and the retired counters of gone ones."""
        for source in [s for s, (at, _) in self._metrics.items() if now - at > self.tunables.fold_after_s]:
            self._retire(source)
        out: list[dict[str, list]] = [self._retired] if self._retired else []
        for source, (at, snapshot) in self._metrics.items():
            if source == exclude:
                continue
            if now - at <= self.tunables.stale_after_s:
                out.append(snapshot)
            else:  # its gauges describe a replica that is not there now
                out.append(to_snapshot(merge([snapshot], kinds=("counter", "histogram"))))
        return out

    def _retire(self, source: str) -> None:
        entry = self._metrics.pop(source, None)
        if entry is not None:
            self._retired = to_snapshot(merge([self._retired, entry[1]], kinds=("counter", "histogram")))


def _routing_key(info: GangStatus) -> tuple[Any, ...]:
    """What a request path acts on in a gang's report (its counters and timings are not)."""
    return (info.state, info.reason, info.generation, info.weights_version, info.data_channel.listening,
            tuple(r.node_id for r in info.ranks))


def gang_source(replica_id: str) -> str:
    return f"gang:{replica_id}"
