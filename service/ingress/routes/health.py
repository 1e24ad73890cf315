"""Liveness, readiness and the gang's description."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from service.ingress.deps import get_gang
from service.ingress.gang_client import GangClient, unavailable_error

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="200 while this process serves HTTP")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="200 when the gang can serve; 503 {error, code} naming why not",
    responses={503: {"description": "gang not ready: starting, rebuilding, broken or unschedulable"}},
)
async def readyz(gang: GangClient = Depends(get_gang)) -> dict[str, Any]:
    info = await gang.describe()
    if info["state"] != "ready":
        raise unavailable_error(info)
    return {"status": "ready", "world_size": info["world_size"], "backend": info["backend"]}


@router.get("/gang", summary="World size, backend, state, weights version and every rank's placement")
async def gang_info(gang: GangClient = Depends(get_gang)) -> dict[str, Any]:
    return await gang.describe()
