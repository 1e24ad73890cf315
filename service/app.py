"""`service.app:build_app`: the Serve application builder.

    serve run deployments/local.yaml
    serve run service.app:build_app world_size=2 init=random checkpoint=/abs/w.safetensors
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from service.config.builder_args import BUILDER_ARGS, AppConfig
from service.contract.errors import describe_validation_errors
from service.cluster.front_door import warn_if_slow_front_door
from service.cluster.placement import check_feasible, cluster_snapshot, gang_request
from service.gang.router import ReadyGangRouter
from service.deployments.controller import Controller
from service.deployments.ingress import Ingress
from service.deployments.gang_server import GangServer
from service.deployments.job_manager import JobManager


class InvalidAppArgs(ValueError):
    """build_app arguments failed validation; the message lists every problem."""


def parse_args(args: dict[str, Any]) -> AppConfig:
    try:
        return AppConfig.model_validate(dict(args))
    except ValidationError as exc:
        # Whole messages: a broken relation names both settings and both values.
        problems = describe_validation_errors(exc.errors(), "args", limit=20, msg_chars=1000)
        raise InvalidAppArgs(
            f"invalid gangserve arguments: {problems}. Valid keys: {', '.join(sorted([*BUILDER_ARGS, 'tunables']))}"
        ) from None


def check_model(cfg: AppConfig) -> None:
    """Refuse, at deploy time, a model that cannot be built or split over the gang, or a local
    checkpoint that does not fit it (service.weights.declared.check_declared_model)."""
    from service.weights.declared import check_declared_model

    try:
        check_declared_model(cfg.model, cfg.gang.world_size)
    except (ValueError, TypeError) as exc:
        raise InvalidAppArgs(f"invalid gangserve arguments: {exc}") from None


def preflight(cfg: AppConfig) -> int | None:
    """Fail at once, naming needed vs available, if the connected cluster can never hold
    the gang (Serve alone would wait forever, warning every 30 s). Skipped when Ray is not
    initialised yet (`serve run module:build_app ...` builds before connecting); the
    ingress then reports the same diagnosis on /readyz and /infer. Returns the number of
    alive nodes (None: not connected)."""
    import ray

    if not ray.is_initialized():
        return None
    snapshot = cluster_snapshot()
    check_feasible(snapshot, gang_request(cfg.gang))
    return len(snapshot.totals)


def build_app(args: dict[str, Any]) -> Application:
    """Validate the arguments, check the cluster can hold the gang, compose the app."""
    cfg = parse_args(args)
    check_model(cfg)
    warn_if_slow_front_door()
    nodes = preflight(cfg)
    return compose_app(cfg, nodes)


# Serve's switches for where a replica runs user code and its handles' router (read by
# the replica process at start, so they travel as the deployment's environment). Ray 2.60
# defaults both to "1" (a separate thread / loop); Ray's own throughput-optimized profile
# and its planned defaults are "0" (ray-project/ray#61226).
SAME_EVENT_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def event_loop_options(cfg: AppConfig) -> dict[str, Any]:
    """ray_actor_options for the request-path deployments (Ingress, GangServer): with
    `same_event_loop`, our code and Serve's share the replica's main loop, saving a
    cross-thread hand-off per request in each of them. The JobManager keeps Serve's
    default (isolation matters more than latency there)."""
    if not cfg.serving.same_event_loop:
        return {}
    return {"runtime_env": {"env_vars": dict(SAME_EVENT_LOOP_ENV)}}


def compose_app(cfg: AppConfig, nodes: int | None = None) -> Application:
    """Ingress -> GangServer, with the gang's bundles reserved all-or-nothing by Serve;
    the Controller owns the fleet view and the weights record, the JobManager the jobs."""
    t = cfg.tunables  # validated with the builder arguments (service.config.builder_args)
    request = gang_request(cfg.gang)
    bundle = dict(request.bundle)
    # One gang per replica: a fixed count, or Serve's autoscaling.
    scale: dict[str, Any] = (
        {"num_replicas": cfg.gang.num_replicas} if cfg.gang.autoscaling_config is None
        else {"autoscaling_config": dict(cfg.gang.autoscaling_config)}
    )
    # Structured logs: Serve's logging_config on every deployment (service.metrics.logs).
    logs: dict[str, Any] = {"logging_config": {"encoding": cfg.serving.log_encoding}} if cfg.serving.log_encoding else {}
    # One replica, no CPU: the app's shared state has one owner (service.deployments.controller).
    controller = Controller.options(**logs).bind(t)
    server = GangServer.options(
        **scale, **logs,
        # Requests go to ready gangs only (replicas report their gang's state).
        request_router_config=RequestRouterConfig(
            request_router_class=ReadyGangRouter,
            request_routing_stats_period_s=t.gang.routing_stats_period_s,
            request_routing_stats_timeout_s=t.gang.routing_stats_timeout_s,
        ),
        # One bundle per rank, reserved all-or-nothing; the replica is rank 0 in bundle 0.
        placement_group_bundles=[dict(bundle) for _ in range(cfg.gang.world_size)],
        placement_group_strategy=cfg.gang.placement_strategy,
        ray_actor_options={"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0), **event_loop_options(cfg)},
        max_ongoing_requests=cfg.serving.max_ongoing_requests,
        max_queued_requests=cfg.serving.max_queued_requests,
        # Serve's default, explicit: the gang server's own drain must fit inside it (service.config.builder_args).
        graceful_shutdown_timeout_s=t.gang.graceful_shutdown_timeout_s,
        health_check_period_s=t.gang.health_check_period_s,
        health_check_timeout_s=t.gang.health_check_timeout_s,
    ).bind(cfg, controller)
    # Training jobs: num_cpus=0, owns the job store, enforces the training quotas.
    jobs = JobManager.options(**logs).bind(cfg.training, cfg.serving.max_seq_len, cfg.model, t)
    return Ingress.options(
        num_replicas=cfg.serving.ingress_replicas,
        # A replica being replaced (redeploy, scale-down) holds requests that wait for a gang
        # (a redeploy replaces a gang by stopping it first): give them the time a new gang
        # takes to come up before Serve kills the replica (Serve's default: 20 s).
        graceful_shutdown_timeout_s=t.ingress.drain_timeout_s,
        max_ongoing_requests=max(256, cfg.serving.max_ongoing_requests),
        **ingress_placement(cfg, nodes), **logs,
    ).bind(server, cfg, jobs, controller)


# Ray's resource of the head node (ray._common.constants.HEAD_NODE_RESOURCE_NAME): 1 on the
# head, absent elsewhere.
HEAD_NODE_RESOURCE = "node:__internal_head__"


def ingress_placement(cfg: AppConfig, nodes: int | None) -> dict[str, Any]:
    """The Ingress deployment's placement options. It only parses HTTP and reserves no logical
    CPU, so the gang gets them all. `head`: every replica asks for a sliver of the head's own
    resource, so it runs beside the head's front door: a worker node lost or cut off takes no
    ingress with it (HAProxy keeps real servers, and no answer waits on a cut link).
    `spread`: at most ceil(replicas / nodes) per node (Serve alone packs 0-CPU replicas)."""
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": 0, **event_loop_options(cfg)}}
    if cfg.serving.ingress_placement == "head":
        options["ray_actor_options"]["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    elif cfg.serving.ingress_replicas > 1 and nodes:
        options["max_replicas_per_node"] = -(-cfg.serving.ingress_replicas // nodes)
    return options
