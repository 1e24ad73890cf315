"""GET /metrics: the whole service's metrics in Prometheus text format (0.0.4).

No token: Prometheus scrapers usually have none, and nothing in it is a secret. Labels
carry route templates (never raw paths), body formats, status codes, gang replica ids,
job statuses and the ids of active training jobs (useless without the API token); no
file-system path, token, tensor or error message. Where even that is too much, keep
/metrics off the public listener (allow it only from Prometheus at the TLS proxy).
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from service.ingress.observe import gather
from service.metrics.exposition import exposition

router = APIRouter(tags=["health"])


@router.get(
    "/metrics",
    summary="Prometheus metrics of the whole service (every gang, ingress replica and the job manager)",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format 0.0.4"}},
)
async def metrics(request: Request) -> Response:
    merged = await gather(request.app.state.metrics_publisher, request.app.state.jobs)
    return Response(exposition(merged), media_type=CONTENT_TYPE_PLAIN_0_0_4)
