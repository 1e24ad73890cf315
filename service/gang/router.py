"""Request routing over several gangs: Serve's power-of-two-choices, over the ready ones only.

Each GangServer replica is one gang. Serve's default router spreads requests over every
RUNNING replica, including one whose gang is BROKEN or REBUILDING (its replica process is
fine): such a gang answers 503 at once, but every request sent to it is still one failed
request. Every replica reports its gang's state as routing stats (`record_routing_stats`,
every `tunables.gang.routing_stats_period_s`); this router keeps to the replicas whose last report said
ready, and falls back to all of them when none did (those answer 503 with the reason, which
is what the caller must see then). Stats are at most one period old, so a gang that just
broke may still get the requests of that period: they fail fast (503), never wait.

Session affinity (service.sessions): a call with a `session_id` keyword goes to the replica
the id names (whatever its gang's state: a rebuilding gang keeps its sessions and
recomputes them); if that replica is gone, to any, which answers 410 `session_lost`.
"""
from __future__ import annotations

import hashlib
import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from service.sessions.ids import named_owner

READY_STAT = "gang_ready"


def routing_stats(ready: bool, weights_version: int) -> dict[str, Any]:
    """What a GangServer replica reports to routers."""
    return {READY_STAT: ready, "weights_version": weights_version}


def session_affinity(session_id: str, candidates: list[RunningReplica]) -> list[RunningReplica] | None:
    """Session affinity: the replica that holds `session_id`. Our ids name it; an OIP
    client's own id goes to the replica of highest rendezvous hash (stable while the set of
    gangs is). None: the holder is gone (any replica then answers 410 `session_lost`)."""
    owner = named_owner(session_id)
    if owner is not None:
        mine = [r for r in candidates if r.replica_id.unique_id == owner]
        return mine or None
    if not candidates:
        return None
    return [max(candidates, key=lambda r: hashlib.sha256(f"{r.replica_id.unique_id}/{session_id}".encode()).digest())]


class ReadyGangRouter(FIFOMixin, RequestRouter):
    """Power of two choices among the replicas whose gang reported ready; a session's calls
    (a `session_id` keyword) go to the gang that holds it."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        session_id = (pending_request.kwargs or {}).get("session_id") if pending_request is not None else None
        if session_id:
            holder = session_affinity(str(session_id), candidate_replicas)
            if holder is not None:
                return [holder]
        ready = [r for r in candidate_replicas if r.routing_stats.get(READY_STAT, True)]
        pool = ready or candidate_replicas  # none ready: let a replica answer with the reason
        if len(pool) <= 2:
            return [random.sample(pool, len(pool))]
        return [random.sample(pool, 2)]
