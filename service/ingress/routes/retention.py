"""Retention: DELETE /train/{id} and DELETE /datasets/{id} (auth). The JobManager does the work.

Deleting a job cancels it first if it is still PENDING or RUNNING (its workers are freed
within seconds), then removes its record, loss history, logs, run dir (its epoch
checkpoints) and final checkpoint. Deleting a dataset is refused (409 `dataset_in_use`) while an active job trains
on it.
"""
from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Depends

from service.ingress.auth import require_token
from service.contract.errors import ErrorCode, NotFound
from service.ingress.jobs_client import JobsClient, get_jobs
from service.ingress.routes.train import job_id_param

router = APIRouter(tags=["training"], dependencies=[Depends(require_token)])

DATASET_ID = re.compile(r"^ds-[0-9a-f]{12}$")


async def dataset_id_param(dataset_id: str) -> str:
    """A well-formed dataset id, else 404 without asking the JobManager."""
    if not DATASET_ID.match(dataset_id):
        raise NotFound(f"no dataset {dataset_id!r} (dataset ids look like ds-0123abcd4567)", code=ErrorCode.DATASET_NOT_FOUND)
    return dataset_id


@router.delete(
    "/train/{job_id}",
    summary="Delete a job: cancel it if active, remove its record, logs, run files and checkpoint",
    responses={401: {"description": "missing/bad token"}, 404: {"description": "no such job"}},
)
async def delete_job(job_id: str = Depends(job_id_param), jobs: JobsClient = Depends(get_jobs)) -> dict[str, Any]:
    return await jobs.call("delete_job", job_id)


@router.delete(
    "/datasets/{dataset_id}",
    summary="Delete an uploaded dataset (409 while an active job trains on it)",
    responses={401: {"description": "missing/bad token"}, 404: {"description": "no such dataset"},
               409: {"description": "an active job uses it"}},
)
async def delete_dataset(dataset_id: str = Depends(dataset_id_param),
                         jobs: JobsClient = Depends(get_jobs)) -> dict[str, Any]:
    return await jobs.call("delete_dataset", dataset_id)
