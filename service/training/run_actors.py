"""The jobs' run actors in Ray: create, find, poll and kill them (service.training.run.TrainRun).

Every call is off the event loop or bounded. A poll answers with what the cluster says
about the run as a service.training.lifecycle observation (Answered, TimedOut, ActorDied),
so the rules that read it never see a Ray exception.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.training.lifecycle import ActorDied, Answered, Observation, TimedOut
from service.training.run import RUN_NAMESPACE, TrainRun, run_actor_name
from service.training.run_snapshot import ResumeState
from service.config.tunables import Tunables

_RemoteTrainRun = ray.remote(TrainRun)
T = TypeVar("T")


class RunActors:
    """The detached, named run actors of the jobs, placed on `node_id` (the manager's node:
    a local artifact store's state dir is known to be mounted there, and the run actor reads
    and writes it: the checkpoint pointer, the final checkpoint, result.json). Each gets the app's `tunables` (default: the defaults),
    which it hands to its workers."""

    def __init__(self, node_id: str, tunables: Tunables | None = None) -> None:
        self._node_id = node_id
        self._tunables = tunables or Tunables()

    async def launch(self, job_id: str, spec: dict[str, Any], dataset_path: str | None,
                     init_key: str | None, resume: ResumeState | None = None) -> Any:
        """Create the job's run actor (TrainRun's arguments); its handle. `resume`: continue a run that died."""
        # Creating a named actor registers the name with the GCS synchronously: off the loop.
        return await asyncio.to_thread(_RemoteTrainRun.options(
            name=run_actor_name(job_id),
            namespace=RUN_NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            max_restarts=0,
            max_concurrency=16,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self._node_id, soft=False),
        ).remote, job_id, spec, dataset_path, init_key, resume, self._tunables)

    @staticmethod
    async def find(job_id: str) -> Any | None:
        """The job's run actor if it exists (a run that survived its manager), else None."""
        try:
            return await asyncio.to_thread(ray.get_actor, run_actor_name(job_id), namespace=RUN_NAMESPACE)
        except ValueError:
            return None

    @staticmethod
    async def poll(handle: Any, log_seq: int, history_seq: int, timeout_s: float) -> Observation:
        """The run's snapshot since `log_seq` / `history_seq`, within `timeout_s`."""
        try:
            snap = await asyncio.wait_for(_await(handle.snapshot.remote(log_seq, True, history_seq)), timeout_s)
        except (asyncio.TimeoutError, GetTimeoutError):
            return TimedOut()
        except RayActorError as exc:
            return ActorDied(type(exc).__name__)
        return Answered(snap)

    @staticmethod
    async def kill(handle: Any) -> None:
        """Kill the run actor (with it, its workers and their placement group); gone already is fine."""
        try:
            await asyncio.to_thread(ray.kill, handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone is fine
            pass


async def _await(ref: Awaitable[T]) -> T:
    return await ref
