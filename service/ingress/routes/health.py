"""Liveness, readiness and the gang's description.

The bodies are declared (service.contract.gang_status): `response_model` gives /openapi.json their
schemas, and `response_model_exclude_unset` keeps a key absent where the producer did not
set it (a synthesized `scheduling` status has no `ranks`), rather than a null.

/gang is public, but shows file-system paths (checkpoint locations, in weights_source or a
reason) only to callers with the API token; everyone else gets them as '<path>'.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from service.contract.gang_status import GangAnswer, GangsView, Readiness, dump
from service.ingress.auth import has_api_token, optional_api_auth, redact_paths
from service.ingress.deps import FleetReader, Gang, get_fleet, get_gang
from service.ingress.readiness import readiness

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="200 while this process serves HTTP")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="200 when the gang can serve; 503 {error, code} naming why not",
    response_model=Readiness,
    response_model_exclude_unset=True,
    responses={503: {"description": "gang not ready: starting, rebuilding, broken or unschedulable"}},
)
async def readyz(gang: Gang = Depends(get_gang), fleet: FleetReader = Depends(get_fleet)) -> Readiness:
    """Ready while at least one gang serves now (service.ingress.readiness, which
    /v2/health/ready shares)."""
    return await readiness(gang, fleet)


@router.get(
    "/gangs",
    summary="Every gang of the app: {desired, ready, gangs: [/gang + replica_id], missing, lost}",
    description="One gang per GangServer replica (`num_replicas`, or autoscaling). `missing` says, for "
    "each desired gang that is not serving, what it waits for. Paths only with the API token.",
    dependencies=[Depends(optional_api_auth)],
    openapi_extra={"security": [{}]},
    response_model=GangsView,
    response_model_exclude_unset=True,
)
async def gangs_info(request: Request, fleet: FleetReader = Depends(get_fleet)) -> dict[str, Any]:
    body = dump(await fleet.gangs())
    return body if has_api_token(request) else redact_paths(body)


@router.get(
    "/gang",
    summary="World size, backend, state, weights version and every rank's placement",
    description="A gang's own report, or (no gang server answers) why there is none: its state "
    "(scheduling, unschedulable), the error code a request gets, and the reason. "
    "File-system paths (e.g. a checkpoint's location) are shown only with the API token.",
    dependencies=[Depends(optional_api_auth)],
    openapi_extra={"security": [{}]},  # the token is optional here
    response_model=GangAnswer,
    response_model_exclude_unset=True,
)
async def gang_info(request: Request, gang: Gang = Depends(get_gang)) -> dict[str, Any]:
    body = dump(await gang.describe())
    return body if has_api_token(request) else redact_paths(body)
