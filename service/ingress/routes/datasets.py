"""Uploaded training datasets: POST /datasets (safetensors `inputs` + `targets`), GET /datasets."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from service.ingress.auth import require_token
from service.config.builder_args import AppConfig
from service.ingress.deps import get_config, read_body_capped
from service.ingress.jobs_client import JobsClient, get_jobs
from service.ingress.schemas import AUTH_RESPONSES

# The API token, on every route (auth.AuthMiddleware checks it before the body is read).
router = APIRouter(tags=["training"], dependencies=[Depends(require_token)], responses=AUTH_RESPONSES)


@router.post(
    "/datasets",
    status_code=201,
    summary="Upload a dataset: safetensors with float tensors inputs/targets ([N,in]/[N,out] or [N,seq,E] twice)",
    openapi_extra={"requestBody": {"content": {"application/x-safetensors": {"schema": {"type": "string", "format": "binary"}}}}},
    responses={400: {"description": "not safetensors"}, 413: {"description": "too large"},
               422: {"description": "wrong names, dtypes, shapes or values"}},
)
async def upload(request: Request, cfg: AppConfig = Depends(get_config),
                 jobs: JobsClient = Depends(get_jobs)) -> dict[str, Any]:
    body = await read_body_capped(request, cfg.serving.max_body_bytes)
    return await jobs.call("upload_dataset", body)


@router.get("/datasets", summary="Uploaded datasets, newest first")
async def list_datasets(jobs: JobsClient = Depends(get_jobs)) -> dict[str, Any]:
    return await jobs.call("list_datasets")
