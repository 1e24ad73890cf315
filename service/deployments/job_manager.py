"""JobManager: the Serve deployment (num_cpus=0) that owns training jobs.

A shell: the jobs' commands, datasets and poll loop are service.training.jobs.Jobs; this
class wires Jobs' real dependencies (the state dir's job store and served weights record,
the artifact store, the run actors on this replica's node, the builder arguments' quotas)
and adds what only a Serve replica has (its app's name, Serve's log routing, Ray's metrics
flusher) and the deployment's options. `check_health` (inherited) fails when the poll loop
is dead or keeps failing, and Serve replaces the replica; the new one adopts the jobs.

Start-up fails (the replica does not start, naming the redacted URL and why) while the
artifact store or the state database cannot be used.
"""
from __future__ import annotations

import asyncio
import logging

import ray
from ray import serve

from service.config.builder_args import ModelConfig, TrainingLimits
from service.metrics.logs import route_logs_to_serve
from service.metrics.process import enable_ray_metrics
from service.state import artifacts
from service.state.db import database_url
from service.state.paths import state_dir
from service.training.jobs import DEFAULT_MAX_SEQ_LEN, Jobs
from service.training.run_actors import RunActors
from service.training.store import JobStore
from service.config.tunables import Tunables
from service.weights.record import WeightsRecord

log = logging.getLogger("gangserve.training")


@serve.deployment(
    name="JobManager",
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=256,
    health_check_period_s=10,
)
class JobManager(Jobs):
    """The training jobs of one app, as a Serve deployment."""

    async def __init__(self, limits: TrainingLimits | None = None, max_seq_len: int | None = None,
                       model: ModelConfig | None = None, tunables: Tunables | None = None) -> None:
        """`limits`: the training quotas (builder arguments; defaults otherwise).
        `max_seq_len`: the serving limit, applied to uploaded attention datasets too.
        `model`: the app's ModelConfig, to regenerate a served version its `init` made.
        `tunables`: the app's (AppConfig.tunables; default, the defaults)."""
        route_logs_to_serve()
        quotas = limits or TrainingLimits()
        tunables = tunables or Tunables()
        state = state_dir()
        # StorageConfigError / StorageUnavailable
        store = await asyncio.to_thread(artifacts.check_reachable, tunables.state)
        records = JobStore(database_url(state), tunables.training, tunables.state)  # StateUnavailable: unreachable
        enable_ray_metrics(tunables.fleet)
        super().__init__(
            store=records,
            artifacts=store,
            weights=WeightsRecord(state, records.database),  # read only: init_from a weights version
            limits=quotas,
            runs=RunActors(ray.get_runtime_context().get_node_id(), tunables),
            app=serve.get_replica_context().app_name,
            app_model=model,
            max_seq_len=int(max_seq_len or DEFAULT_MAX_SEQ_LEN),
            tunables=tunables.training,
        )
        await self.open()
        log.info("job manager %s on state dir %s", self.manager_id, state)

    async def __del__(self) -> None:
        """Serve's graceful shutdown (redeploy, scale-down, app delete) awaits this: the poll loop
        stops before the replica's event loop and its thread pool do, instead of failing its next
        round against a closed pool (an ERROR line at every stop). The runs keep running; the
        app's next manager adopts them."""
        if getattr(self, "_poller", None) is not None:  # set once __init__ got that far
            await self.close()
