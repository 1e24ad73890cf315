"""The ingress's side of observability: one ASGI middleware measures every request, and
`GET /metrics` gathers the whole service's figures at scrape time.

`RequestMetrics` (outermost layer of the app, so 401s, 404s and 413s count too) records
per request: `gangserve_requests_total{route, format, code, protocol}`, `gangserve_request_seconds
{route, protocol}` and `gangserve_request_bytes{route, protocol}` (`record_request`; the gRPC
calls are counted the same way by service.ingress.oip_grpc.service, `protocol="grpc"`). `route` is the matched route's template
(`/train/{job_id}`), never the raw path (bounded cardinality, no ids or paths in labels);
`unmatched` for anything no route took. `format` comes from the request's Content-Type
(json, npy, safetensors, binary, form, other; none without a body type).

Request ids: Ray Serve (2.60) itself takes the client's `X-Request-Id` or assigns one, in
its HTTP server (the proxy, and direct ingress alike), makes it the Serve request id that
its log lines carry, and echoes it as the `X-Request-ID` response header. The service
adds no second header; see service.metrics.logs for how the service's own log lines get it.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.ingress.fleet_client import FleetClient
from service.metrics.exposition import merge
from service.metrics.process import MetricSet, process_metrics

log = logging.getLogger("gangserve.ingress")


_FORMATS = {
    "application/json": "json",
    "application/x-npy": "npy",
    "application/x-safetensors": "safetensors",
    "application/octet-stream": "binary",
    "application/x-www-form-urlencoded": "form",
    "multipart/form-data": "form",
}


def body_format(content_type: str | None) -> str:
    if not content_type:
        return "none"
    return _FORMATS.get(content_type.split(";", 1)[0].strip().lower(), "other")


class RequestMetrics:
    """Pure ASGI middleware: counts and times every HTTP request into this process's metrics."""

    def __init__(self, app: ASGIApp, metrics: MetricSet | None = None, publisher: "Publisher | None" = None) -> None:
        self.app = app
        self.metrics = metrics or process_metrics()
        self.metrics.declare("gangserve_shm_fallbacks")
        self.publisher = publisher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.publisher is not None:
            self.publisher.ensure_started()
        started = time.perf_counter()
        read = 0
        status = 500  # if the app fails before answering

        async def counting_receive() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
            return message

        async def status_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, counting_receive, status_send)
        finally:
            route = route_template(scope)
            content_type = None
            for key, value in scope.get("headers") or ():
                if key == b"content-type":
                    content_type = value.decode("latin-1")
                    break
            record_request(self.metrics, "http", route, body_format(content_type), status,
                           time.perf_counter() - started, read)


def record_request(metrics: MetricSet, protocol: str, route: str, body: str, status: int, seconds: float,
                   read: int) -> None:
    """One answered request into `metrics`, HTTP's and gRPC's alike (`protocol`: http, grpc)."""
    metrics.inc("gangserve_requests", (route, body, str(status), protocol))
    metrics.observe("gangserve_request_seconds", seconds, (route, protocol))
    metrics.observe("gangserve_request_bytes", read, (route, protocol))


def route_template(scope: Scope) -> str:
    """The template of the route that took the request; for a request answered before
    routing (a 401 from auth), the documented route its path fits; `unmatched` if none."""
    path = getattr(scope.get("route"), "path", None)
    if path:
        return path
    from starlette.routing import get_route_path

    wanted = get_route_path(scope)
    for pattern, template in _templates(scope.get("app")):
        if pattern.match(wanted):
            return template
    return "unmatched"


_TEMPLATES: dict[int, list[tuple[re.Pattern[str], str]]] = {}


def _templates(app: Any) -> list[tuple[re.Pattern[str], str]]:
    """(regex, template) of every route in the app's OpenAPI description (built once per app)."""
    if app is None or not hasattr(app, "openapi"):
        return []
    key = id(app)
    if key not in _TEMPLATES:
        try:
            paths = list(app.openapi().get("paths", {}))
        except Exception:  # noqa: BLE001
            paths = []
        _TEMPLATES[key] = [(re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(p)) + "$"), p)
                           for p in paths]
    return _TEMPLATES[key]


class Publisher:
    """Reports this ingress replica's metrics to the app's Controller every
    fleet.metrics_report_interval_s (started by the first request), so a scrape of any other ingress
    replica of the app counts them too."""

    def __init__(self, fleet: FleetClient, source: str | None) -> None:
        self.fleet, self.source = fleet, source
        self._task: asyncio.Task[None] | None = None

    @property
    def active(self) -> bool:
        return self.fleet.connected and self.source is not None

    def ensure_started(self) -> None:
        if not self.active or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.fleet.report_metrics(self.source, process_metrics().snapshot())  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - best effort; the next round retries
                log.warning("could not report this ingress replica's metrics: %s", exc)
            await asyncio.sleep(self.fleet.tunables.fleet.metrics_report_interval_s)


def replica_identity() -> tuple[str, str] | None:
    """(app, replica id) inside a Serve replica, else None (tests building the app alone)."""
    try:
        from ray import serve

        context = serve.get_replica_context()
        return context.app_name, context.replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica
        return None


def make_publisher(fleet: FleetClient) -> Publisher:
    identity = replica_identity()
    return Publisher(fleet, f"ingress:{identity[1]}" if identity else None)


async def gather(publisher: Publisher, jobs: Any) -> dict[str, dict[tuple[str, ...], Any]]:
    """The whole service's figures: this replica's live values, every other replica's
    reported ones (plus those of replicas that are gone), and the JobManager's."""
    snapshots: list[dict[str, list]] = [process_metrics().snapshot()]
    if publisher.active:
        try:
            snapshots += await publisher.fleet.metrics(exclude=publisher.source)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not read the other replicas' metrics: %s", exc)
    if jobs is not None:
        try:
            snapshots.append(await asyncio.wait_for(jobs.call("metrics"),
                                                    publisher.fleet.tunables.ingress.jobs_metrics_timeout_s))
        except Exception as exc:  # noqa: BLE001 - no JobManager, or it is busy: no training figures
            log.debug("no training metrics this scrape: %s", exc)
    return merge(snapshots)
