"""Training jobs: POST /train, GET /train, GET /train/{id}, POST /train/{id}/cancel,
GET /train/{id}/checkpoint, GET /train/{id}/logs. The JobManager does the work.

Every route needs the API token, reads included (job specs, trained weights and logs are
not public): `auth.AuthMiddleware` checks it before any body is read, and the router's
`require_token` dependency declares the scheme in OpenAPI."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from service.ingress.auth import require_token
from service.contract.errors import BadRequest, ErrorCode, NotFound
from service.config.builder_args import AppConfig
from service.ingress.deps import get_config, read_body_capped
from service.ingress.jobs_client import JobsClient, get_jobs
from service.ingress.schemas import AUTH_RESPONSES, inline_defs
from service.state import artifacts
from service.training.public import JobList, JobView
from service.training.spec import JobSpec

router = APIRouter(tags=["training"], dependencies=[Depends(require_token)], responses=AUTH_RESPONSES)

# A job spec is small; anything bigger is not one.
MAX_SPEC_BYTES = 64 * 1024
JOB_ID = re.compile(r"^job-[0-9a-z]{1,64}$")


def _spec_schema() -> dict[str, Any]:
    return inline_defs(JobSpec.model_json_schema())


async def job_id_param(job_id: str) -> str:
    """A well-formed job id, else 404 without asking the JobManager."""
    if not JOB_ID.match(job_id):
        raise NotFound(f"no training job {job_id!r} (job ids look like job-0123abcd4567)", code=ErrorCode.JOB_NOT_FOUND)
    return job_id


@router.post(
    "/train",
    status_code=202,
    summary="Start a DDP training job (one Ray actor per rank); 202 + Location: /train/{id}",
    openapi_extra={"requestBody": {"content": {"application/json": {"schema": _spec_schema()}}}},
    responses={422: {"description": "invalid spec, infeasible job, or an init_from that does not exist "
                                    "(init_from_not_found) or has another shape (init_from_mismatch)"},
               409: {"description": "init_from names a job that has not SUCCEEDED (init_from_not_ready)"},
               202: {"model": JobView, "description": "The new job, PENDING"}},
)
async def submit(request: Request, jobs: JobsClient = Depends(get_jobs)) -> JSONResponse:
    body = await read_body_capped(request, MAX_SPEC_BYTES)
    try:
        doc: Any = json.loads(body) if body.strip() else {}
    except ValueError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"body must be a JSON object (the job spec), got {type(doc).__name__}")
    job = await jobs.call("submit", doc)  # the JobManager validates (422 with every problem)
    return JSONResponse(job, status_code=202, headers={"Location": f"/train/{job['id']}"})


@router.get("/train", summary="Jobs, newest first: {jobs, next}", response_model=JobList)
async def list_jobs(
    limit: int = Query(20, ge=1, le=200), cursor: str | None = Query(None, max_length=32),
    jobs: JobsClient = Depends(get_jobs),
) -> dict[str, Any]:
    return await jobs.call("list_jobs", limit, cursor)


@router.get("/train/{job_id}", summary="One job: status, progress, history, error, checkpoint",
            response_model=JobView)
async def get_job(job_id: str = Depends(job_id_param), jobs: JobsClient = Depends(get_jobs)) -> dict[str, Any]:
    return await jobs.call("get_job", job_id)


@router.post("/train/{job_id}/cancel", summary="Stop a job and free its resources", response_model=JobView,
             responses={409: {"description": "the job already ended (job_finished)"}})
async def cancel(job_id: str = Depends(job_id_param), jobs: JobsClient = Depends(get_jobs)) -> dict[str, Any]:
    return await jobs.call("cancel", job_id)


@router.get(
    "/train/{job_id}/checkpoint",
    summary="The final checkpoint (safetensors; dense attention contract format for attention jobs)",
    response_class=Response,
    responses={200: {"content": {"application/x-safetensors": {}}}, 409: {"description": "job has none"},
               503: {"description": "the artifact store cannot be reached (storage_unavailable)"}},
)
async def checkpoint(job_id: str = Depends(job_id_param), jobs: JobsClient = Depends(get_jobs),
                     cfg: AppConfig = Depends(get_config)) -> Response:
    """Streamed from the artifact store: a local file as it is, an S3 object in chunks (the
    object is opened before the reply starts, so a store outage is a 503, not a cut reply)."""
    key = await jobs.call("checkpoint_key", job_id)
    store = artifacts.store(cfg.tunables.state)
    filename = f"{job_id}.safetensors"
    if store.local:
        return FileResponse(store.path(key), media_type="application/x-safetensors", filename=filename)
    try:
        size = await asyncio.to_thread(store.size, key)
        chunks = await asyncio.to_thread(store.iter_chunks, key)
    except FileNotFoundError:  # deleted between the JobManager's answer and now
        raise NotFound(f"job {job_id}'s checkpoint is gone from {store.url}", code=ErrorCode.CHECKPOINT_NOT_FOUND) from None
    return StreamingResponse(iterate_in_threadpool(chunks), media_type="application/x-safetensors",
                             headers={"Content-Disposition": f'attachment; filename="{filename}"',
                                      "Content-Length": str(size)})


@router.get("/train/{job_id}/logs", summary="The job's recent log lines")
async def logs(job_id: str = Depends(job_id_param), tail: int = Query(200, ge=1, le=2000),
               jobs: JobsClient = Depends(get_jobs)) -> dict[str, Any]:
    return await jobs.call("logs", job_id, tail)


