"""The Ingress Serve deployment: builds the FastAPI app around a GangServer handle, and answers
the Open Inference Protocol over gRPC beside it (service.ingress.oip_grpc)."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from service.cluster.front_door import cap_grpc_messages, carry_grpc_deadlines, own_header_deadlines
from service.cluster.heap import keep_freed_buffers
from service.config.builder_args import AppConfig
from service.ingress.api import create_api
from service.ingress.fleet_client import FleetClient
from service.ingress.jobs_client import JobsClient
from service.ingress.oip_grpc.service import OipGrpc, Tokens
from service.ingress.requests import connect
from service.metrics.logs import route_logs_to_serve
from service.metrics.process import enable_ray_metrics


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    """HTTP and gRPC: parses, validates and forwards to the GangServer; owns no actors.

    The methods named like the RPCs of `inference.GRPCInferenceService` are gRPC's: Serve's
    gRPC server in this replica (behind HAProxy's gRPC frontend, service.cluster.front_door)
    calls them with the request's raw bytes and its `grpc_context`."""

    def __init__(self, gang: DeploymentHandle, config: AppConfig, jobs: DeploymentHandle | None = None,
                 controller: DeploymentHandle | None = None) -> None:
        """`config`: the app's validated configuration (service.app binds the object itself)."""
        route_logs_to_serve()
        keep_freed_buffers()  # a request's body, output and reply reuse the heap (service.cluster.heap)
        self._config = config
        enable_ray_metrics(self._config.tunables.fleet)
        own_header_deadlines()  # the request's stated deadline is ours alone (service.cluster.front_door)
        carry_grpc_deadlines()  # a gRPC call's deadline reaches the methods below
        cap_grpc_messages(config.serving.max_body_bytes)  # before Serve starts this replica's gRPC server
        # /gangs, /readyz, rollouts, /metrics, the pushed gang status -> the Controller
        self._fleet = FleetClient(controller, self._config, app_name=serve.get_replica_context().app_name)
        self._gang = connect(gang, self._config, self._fleet)  # the request policy over the GangServer handle
        self._jobs = JobsClient(jobs, self._config.tunables.ingress.jobs_call_timeout_s)  # training routes -> the JobManager deployment
        self._grpc: OipGrpc | None = None  # built with the app: it shares its tokens, decode pool and metrics

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_api(self._config, self._gang, self._jobs, self._fleet, weights_admin=self._gang.weights)
        state = app.state
        self._grpc = OipGrpc(self._config, self._gang, self._fleet, state.decode_pool,
                             Tokens(api=state.api_token, infer=state.infer_token), state.metrics_publisher)
        return app

    @property
    def _oip(self) -> OipGrpc:
        if self._grpc is None:  # Serve builds the app before it starts this replica's gRPC server
            raise RuntimeError("the gRPC service is built with the app; the app was not built")
        return self._grpc

    # ------------------------------------------------ inference.GRPCInferenceService (service.ingress.oip_grpc)

    async def ServerLive(self, request: bytes, grpc_context: Any) -> Any:  # noqa: N802 - the RPC's name
        return await self._oip.server_live(request, grpc_context)

    async def ServerReady(self, request: bytes, grpc_context: Any) -> Any:  # noqa: N802
        return await self._oip.server_ready(request, grpc_context)

    async def ModelReady(self, request: bytes, grpc_context: Any) -> Any:  # noqa: N802
        return await self._oip.model_ready(request, grpc_context)

    async def ServerMetadata(self, request: bytes, grpc_context: Any) -> Any:  # noqa: N802
        return await self._oip.server_metadata(request, grpc_context)

    async def ModelMetadata(self, request: bytes, grpc_context: Any) -> Any:  # noqa: N802
        return await self._oip.model_metadata(request, grpc_context)

    async def ModelConfig(self, request: bytes, grpc_context: Any) -> Any:  # noqa: N802
        return await self._oip.model_config(request, grpc_context)

    async def ModelInfer(self, request: bytes, grpc_context: Any) -> Any:  # noqa: N802
        return await self._oip.model_infer(request, grpc_context)

    async def ModelStreamInfer(self, requests: AsyncIterator[bytes], grpc_context: Any) -> AsyncIterator[Any]:  # noqa: N802
        async for response in self._oip.model_stream_infer(requests, grpc_context):
            yield response
