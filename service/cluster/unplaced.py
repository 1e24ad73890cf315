"""Gangs that were never placed, when their app is deleted: released at once (issue 43).

Serve reserves a GangServer replica's placement group (one bundle per rank) before the
replica's actor starts. A gang the cluster cannot hold (more GPU ranks than it has, nodes
gone) leaves its replica pending: the group PENDING, the actor never created, nothing held.
Deleting the app, Serve asks that replica to shut down gracefully; an actor that never
started never answers, so Serve waited out the GangServer's graceful_shutdown_timeout_s
(tunables.gang, 20 s) before killing it, and only then was the app gone.

No code of ours runs in that replica, so the app's Controller (placed with no resources,
always running) does it: every `tunables.fleet.watch_interval_s` it looks for PENDING
groups of its app's GangServer replicas, and only when there is one asks Serve for the
deployment's state. Once Serve is deleting that deployment (its target: no replica), it
kills those replicas' actors (never started: their creation is cancelled); Serve finds each
gone, counts it stopped at once and removes its group. (Removing the group alone leaves the
actor pending, and Serve waiting.)

Only once the deployment is being deleted, not merely the app: killing a pending replica
Serve still wants counts as a failed start, and Serve starts another (under `serve
shutdown` it stops an app's deployments one after another, so the app is DELETING while
its GangServer deployment still has a target). A group that was placed (CREATED, or
RESCHEDULING after a node loss) belongs to a replica that runs its own graceful shutdown
(service.deployments.gang_server.GangServer.__del__).
"""
from __future__ import annotations

from dataclasses import dataclass

GANG_DEPLOYMENT = "GangServer"  # service.deployments.gang_server's Serve deployment name
PENDING = "PENDING"  # Ray's state of a placement group none of whose bundles is reserved yet
STATUS_TIMEOUT_S = 5.0  # one question to Serve's controller; a busy one is asked again next look


@dataclass(frozen=True)
class PendingGang:
    """One never-placed gang: its Serve replica's actor name (its placement group's too) and
    replica id."""

    actor_name: str
    replica_id: str


@dataclass(frozen=True)
class Sweep:
    """What one look found: whether Serve is deleting the app's GangServer deployment (asked
    only when a gang of it is pending), and the pending gangs whose actors were killed."""

    deleting: bool
    released: tuple[PendingGang, ...] = ()


def pending_gangs(app: str) -> list[PendingGang]:
    """The app's GangServer replicas whose placement group is still PENDING (one GCS read).
    Serve names a replica's group after the replica (ReplicaID.to_full_id_str)."""
    import ray
    from ray.serve._private.common import ReplicaID

    found = []
    for info in ray.util.placement_group_table().values():
        name = info.get("name") or ""
        if info.get("state") != PENDING or not ReplicaID.is_full_id_str(name):
            continue
        try:
            replica = ReplicaID.from_full_id_str(name)
        except (ValueError, IndexError):
            continue
        if replica.deployment_id.app_name == app and replica.deployment_id.name == GANG_DEPLOYMENT:
            found.append(PendingGang(name, replica.unique_id))
    return found


def gang_deleting(app: str) -> bool:
    """Whether Serve is deleting the app's GangServer deployment (its target is no replica:
    every replica of it is being stopped, none replaced). One call to Serve's controller."""
    import ray
    from ray.serve._private.common import DeploymentStatusInfo, DeploymentStatusTrigger
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.serve.generated.serve_pb2 import DeploymentStatusInfo as DeploymentStatusProto

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    raw = ray.get(controller.get_deployment_status.remote(GANG_DEPLOYMENT, app), timeout=STATUS_TIMEOUT_S)
    if raw is None:
        return False
    status = DeploymentStatusInfo.from_proto(DeploymentStatusProto.FromString(raw))
    return status.status_trigger == DeploymentStatusTrigger.DELETING


def sweep(app: str) -> Sweep:
    """One look (blocking: run it off the event loop): when the app has pending gangs and
    Serve is deleting its GangServer deployment, kill their replicas' actors."""
    pending = pending_gangs(app)
    if not pending or not gang_deleting(app):
        return Sweep(deleting=False)
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    released = []
    for gang in pending:
        try:
            ray.kill(ray.get_actor(gang.actor_name, namespace=SERVE_NAMESPACE), no_restart=True)
            released.append(gang)
        except ValueError:  # gone meanwhile (Serve's own stop got there first)
            pass
    return Sweep(deleting=True, released=tuple(released))
