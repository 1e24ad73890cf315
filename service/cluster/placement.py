"""Can the cluster ever hold the gang? Checked before anything waits.

Pure functions over per-node resource totals (testable without Ray), plus a snapshot of
the live cluster. Messages always name both sides, e.g.

    gang needs 4 x {GPU: 1} (STRICT_SPREAD); cluster has 2 GPU on 2 nodes
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from service.config.builder_args import GangConfig
from service.contract.errors import ErrorCode, GangServeError

log = logging.getLogger("gangserve.placement")

# Ray reports these alongside real resources; they never constrain a gang.
_IGNORED_PREFIXES = ("node:", "memory", "object_store_memory", "accelerator_type:")


class GangUnschedulable(GangServeError):
    """The cluster can never place the gang (or gave up waiting); says needed vs available."""

    code = ErrorCode.UNSCHEDULABLE
    retry_after_s = 30.0


@dataclass(frozen=True)
class GangRequest:
    """world_size identical bundles placed with one Ray placement strategy."""

    world_size: int
    bundle: Mapping[str, float]
    strategy: str
    gangs: int = 1  # independent gangs (GangServer replicas), each its own placement group

    def describe(self) -> str:
        one = f"{self.world_size} x {_fmt(self.bundle)} ({self.strategy})"
        return one if self.gangs == 1 else f"{self.gangs} gangs of {one}"


@dataclass(frozen=True)
class ClusterSnapshot:
    """Per alive node: resource totals (what it can ever offer) and what is free now."""

    totals: list[dict[str, float]]
    free: list[dict[str, float]] = field(default_factory=list)

    def summary(self, request: GangRequest, which: str = "totals") -> str:
        nodes = self.totals if which == "totals" else self.free
        parts = []
        for key in request.bundle:
            amount = sum(n.get(key, 0.0) for n in nodes)
            holders = sum(1 for n in nodes if n.get(key, 0.0) > 0)
            parts.append(f"{_num(amount)} {key} on {holders} node{'s' if holders != 1 else ''}")
        label = "cluster has" if which == "totals" else "free now:"
        return f"{label} {', '.join(parts)} ({len(self.totals)} alive node{'s' if len(self.totals) != 1 else ''})"


def gang_request(cfg: GangConfig) -> GangRequest:
    """What the gang needs from the cluster: world_size bundles of one rank's resources."""
    bundle: dict[str, float] = {"CPU": cfg.cpus_per_rank}
    if cfg.use_gpu:
        bundle["GPU"] = 1
    return GangRequest(world_size=cfg.world_size, bundle=bundle, strategy=cfg.placement_strategy,
                       gangs=cfg.min_gangs)


def bundles_per_node(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many copies of `bundle` fit on `node` (exact for identical bundles)."""
    fits = math.inf
    for key, need in bundle.items():
        if need <= 0:
            continue
        fits = min(fits, math.floor(node.get(key, 0.0) / need + 1e-9))
    return 0 if fits == math.inf else int(fits)


def fits(nodes: list[dict[str, float]], request: GangRequest) -> bool:
    """Whether `nodes` (totals or free amounts) can hold every bundle of every gang under the
    strategy (each gang is its own placement group; gangs may share nodes).

    STRICT_PACK: each gang on one node, so sum(k // ws) >= gangs. STRICT_SPREAD: each gang
    on ws distinct nodes, and a node serves at most one bundle per gang, so a node holding k
    bundles contributes min(k, gangs): feasible iff that sum reaches gangs * ws.
    """
    per_node = [bundles_per_node(n, request.bundle) for n in nodes]
    ws, gangs = request.world_size, request.gangs
    if request.strategy == "STRICT_PACK":
        return sum(k // ws for k in per_node) >= gangs
    if request.strategy == "STRICT_SPREAD":
        return sum(1 for k in per_node if k >= 1) >= ws and sum(min(k, gangs) for k in per_node) >= gangs * ws
    return sum(per_node) >= ws * gangs  # PACK / SPREAD: best effort over nodes


def check_feasible(snapshot: ClusterSnapshot, request: GangRequest) -> None:
    """Raise GangUnschedulable if the cluster's totals can never hold the gang."""
    if not fits(snapshot.totals, request):
        raise GangUnschedulable(
            f"gang needs {request.describe()}; {snapshot.summary(request)}. "
            "Lower world_size or cpus_per_rank, change placement_strategy, or add nodes."
        )


def waiting_reason(snapshot: ClusterSnapshot | None, request: GangRequest, unknown_why: str = "") -> str:
    """What the gang waits for and what is free now (`snapshot` None: free resources unknown,
    `unknown_why` says why)."""
    if snapshot is None:
        return f"waiting for {request.describe()}; free resources unknown ({unknown_why or 'no snapshot'})"
    return f"waiting for {request.describe()}; {snapshot.summary(request, 'free')}"


def cluster_snapshot() -> ClusterSnapshot:
    """Alive nodes' totals and free resources from the connected Ray cluster."""
    import ray
    from ray._private.state import available_resources_per_node

    alive = [n for n in ray.nodes() if n.get("Alive")]
    totals = [_clean(n.get("Resources", {})) for n in alive]
    try:
        free_by_id = available_resources_per_node()
        free = [_clean(free_by_id.get(n["NodeID"], {})) for n in alive]
    except Exception:  # private API; the totals alone still decide feasibility
        free = []
    return ClusterSnapshot(totals=totals, free=free)


def _clean(resources: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in resources.items() if not k.startswith(_IGNORED_PREFIXES)}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _fmt(bundle: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in bundle.items()) + "}"


class SharedSnapshot:
    """The live cluster's snapshot for one process's async callers (the ingress's request
    path, its readiness and /gangs): at most one read in flight, shared by every caller,
    reused for `max_age_s`; a caller waits for it at most `timeout_s` and gets None after
    that (the read goes on in its thread and serves the callers after it).

    Why: Ray's state reads are synchronous calls to the GCS (one at a time per process),
    which stall as long as the GCS does, up to its 60 s request timeout; a request waiting
    on them, or many of them filling the default thread pool, would wait as long.
    """

    def __init__(self, read: Callable[[], ClusterSnapshot] = cluster_snapshot, *, max_age_s: float,
                 timeout_s: float) -> None:
        self._read = read
        self.max_age_s, self.timeout_s = max_age_s, timeout_s
        self._last: ClusterSnapshot | None = None
        self._last_at = 0.0
        self._pending: asyncio.Future[ClusterSnapshot] | None = None
        self.why_none = ""  # why the last get() returned None

    async def get(self) -> ClusterSnapshot | None:
        """A snapshot at most `max_age_s` old, or None (`why_none` says why) when none came
        within `timeout_s` or the read failed."""
        if self._last is not None and time.monotonic() - self._last_at <= self.max_age_s:
            return self._last
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(asyncio.to_thread(self._read))
            self._pending.add_done_callback(self._keep)
        read = self._pending
        done, _ = await asyncio.wait({read}, timeout=self.timeout_s)  # never cancels the read
        if not done:
            self.why_none = f"Ray's GCS did not answer within {self.timeout_s:g}s"
            return None
        if read.cancelled() or read.exception() is not None:
            self.why_none = f"reading them failed: {read.exception()!r}" if not read.cancelled() else "read cancelled"
            return None
        return read.result()

    def _keep(self, read: asyncio.Future[ClusterSnapshot]) -> None:
        if read.cancelled():
            return
        if read.exception() is not None:
            log.warning("reading the cluster's resources failed: %r", read.exception())
            return
        self._last, self._last_at = read.result(), time.monotonic()
