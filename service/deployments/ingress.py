"""The Ingress Serve deployment: builds the FastAPI app around a GangServer handle."""
from __future__ import annotations

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from service.cluster.front_door import own_header_deadlines
from service.cluster.heap import keep_freed_buffers
from service.config.builder_args import AppConfig
from service.ingress.api import create_api
from service.ingress.fleet_client import FleetClient
from service.ingress.jobs_client import JobsClient
from service.ingress.requests import connect
from service.metrics.logs import route_logs_to_serve
from service.metrics.process import enable_ray_metrics


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    """HTTP only: parses, validates and forwards to the GangServer; owns no actors."""

    def __init__(self, gang: DeploymentHandle, config: AppConfig, jobs: DeploymentHandle | None = None,
                 controller: DeploymentHandle | None = None) -> None:
        """`config`: the app's validated configuration (service.app binds the object itself)."""
        route_logs_to_serve()
        keep_freed_buffers()  # a request's body, output and reply reuse the heap (service.cluster.heap)
        self._config = config
        enable_ray_metrics(self._config.tunables.fleet)
        own_header_deadlines()  # the request's stated deadline is ours alone (service.cluster.front_door)
        # /gangs, /readyz, rollouts, /metrics, the pushed gang status -> the Controller
        self._fleet = FleetClient(controller, self._config, app_name=serve.get_replica_context().app_name)
        self._gang = connect(gang, self._config, self._fleet)  # the request policy over the GangServer handle
        self._jobs = JobsClient(jobs, self._config.tunables.ingress.jobs_call_timeout_s)  # training routes -> the JobManager deployment

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_api(self._config, self._gang, self._jobs, self._fleet)
