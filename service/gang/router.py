"""Request routing over several gangs: Serve's power-of-two-choices, over the ready ones only.

Each GangServer replica is one gang. Serve's default router spreads requests over every
RUNNING replica, including one whose gang is BROKEN or REBUILDING (its replica process is
fine): such a gang answers 503 at once, but every request sent to it is still one failed
request. Every replica reports its gang's state as routing stats (`record_routing_stats`,
every `ROUTING_STATS_PERIOD_S`); this router keeps to the replicas whose last report said
ready, and falls back to all of them when none did (those answer 503 with the reason, which
is what the caller must see then). Stats are at most one period old, so a gang that just
broke may still get the requests of that period: they fail fast (503), never wait.
"""
from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from service.tunables import TUNABLES

ROUTING_STATS_PERIOD_S = TUNABLES.gang.routing_stats_period_s
ROUTING_STATS_TIMEOUT_S = TUNABLES.gang.routing_stats_timeout_s
READY_STAT = "gang_ready"


def routing_stats(ready: bool, weights_version: int) -> dict[str, Any]:
    """What a GangServer replica reports to routers."""
    return {READY_STAT: ready, "weights_version": weights_version}


class ReadyGangRouter(FIFOMixin, RequestRouter):
    """Power of two choices among the replicas whose gang reported ready."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        ready = [r for r in candidate_replicas if r.routing_stats.get(READY_STAT, True)]
        pool = ready or candidate_replicas  # none ready: let a replica answer with the reason
        if len(pool) <= 2:
            return [random.sample(pool, len(pool))]
        return [random.sample(pool, 2)]
