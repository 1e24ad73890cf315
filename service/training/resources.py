"""Fail-fast placement checks in front of a run's worker group (whose placement group waits
for an unplaceable bundle forever: the job would stay PENDING until schedule_timeout_s).

`infeasible_reason` answers "can this cluster EVER hold the job?" from each alive node's
total resources with the serving gang's check (`placement.fits`: a worker's bundle must fit
whole on one node), and words the answer for a job.
"""
from __future__ import annotations

from service.cluster.placement import ClusterSnapshot, GangRequest, bundles_per_node, fits, waiting_reason

Resources = dict[str, float]


def fmt(resources: Resources) -> str:
    """{'CPU': 0.5, 'GPU': 1.0} -> '{CPU: 0.5, GPU: 1}'."""
    parts = [f"{k}: {v:g}" for k, v in sorted(resources.items())]
    return "{" + ", ".join(parts) + "}"


def infeasible_reason(bundle: Resources, count: int, nodes: list[Resources], strategy: str = "PACK") -> str | None:
    """None if `count` workers of `bundle` fit the cluster's totals under `strategy`; else a
    message with needed vs available numbers."""
    if fits(nodes, GangRequest(world_size=count, bundle=bundle, strategy=strategy)):
        return None
    if strategy == "STRICT_SPREAD":
        holders = sum(1 for n in nodes if bundles_per_node(n, bundle) >= 1)
        return (
            f"the cluster can never hold this job: STRICT_SPREAD needs {count} node(s) that can each hold a "
            f"worker of {fmt(bundle)}; the cluster has {holders} such node(s) of {len(nodes)} alive"
        )
    placeable = sum(bundles_per_node(node, bundle) for node in nodes)
    needed = {k: v * count for k, v in bundle.items()}
    have = {k: sum(n.get(k, 0.0) for n in nodes) for k in bundle}
    per_node = "; ".join(fmt({k: n.get(k, 0.0) for k in bundle}) for n in nodes) or "none"
    return (
        f"the cluster can never hold this job: it needs {count} worker(s) x {fmt(bundle)} = {fmt(needed)}, "
        f"each worker's bundle on a single node; the cluster has {fmt(have)} in total on {len(nodes)} alive "
        f"node(s) (per node: {per_node}), room for at most {placeable} such worker(s)"
    )


def pending_reason(bundle: Resources, count: int, snapshot: ClusterSnapshot, strategy: str = "PACK") -> str:
    """'waiting for 2 x {CPU: 0.5} (PACK); free now: ...', worded as the serving gang's."""
    return waiting_reason(snapshot, GangRequest(world_size=count, bundle=bundle, strategy=strategy))
