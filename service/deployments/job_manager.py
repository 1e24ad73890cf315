"""JobManager: the Serve deployment (num_cpus=0) that owns training jobs.

A shell: the jobs' commands, datasets and poll loop are service.training.jobs.Jobs; this
class adds what only a Serve replica has (its app's name, Serve's log routing) and the
deployment's options. `check_health` (inherited) fails when the poll loop is dead or keeps
failing, and Serve replaces the replica; the new one adopts the jobs.
"""
from __future__ import annotations

from typing import Any

from ray import serve

from service.logs import route_logs_to_serve
from service.training.jobs import Jobs


@serve.deployment(
    name="JobManager",
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=256,
    health_check_period_s=10,
)
class JobManager(Jobs):
    """The training jobs of one app, as a Serve deployment (arguments: see Jobs.start)."""

    async def __init__(self, limits: dict[str, Any] | None = None, max_seq_len: int | None = None,
                       model: dict[str, Any] | None = None) -> None:
        route_logs_to_serve()
        await self.start(limits, max_seq_len, model, app=serve.get_replica_context().app_name)
