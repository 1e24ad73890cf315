"""POST /weights: hot-swap the serving gang to a trained attention checkpoint.

Body: {"job_id": "job-..."} (a SUCCEEDED attention job) or {"checkpoint": "<path>"} (a
dense checkpoint inside the state dir; `..` and symlinks out of it are refused). The
JobManager resolves the path; the GangServer swaps between requests (two-phase, through its
sequencer), so in-flight requests finish on the old weights and none fails.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from service.auth import require_token
from service.ingress.deps import get_gang
from service.ingress.gang_client import GangClient
from service.ingress.jobs_client import JobsClient, get_jobs

router = APIRouter(tags=["training"])


class WeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str | None = Field(None, max_length=64, description="A SUCCEEDED attention training job.")
    checkpoint: str | None = Field(None, max_length=4096, description="A dense checkpoint path inside the state dir.")


@router.post(
    "/weights",
    summary="Load a trained checkpoint into the running gang (no restart, no dropped requests)",
    dependencies=[Depends(require_token)],
    responses={404: {"description": "no such job/checkpoint"}, 409: {"description": "shape mismatch or job not finished"},
               422: {"description": "path outside the state dir"}},
)
async def load_weights(req: WeightsRequest, jobs: JobsClient = Depends(get_jobs),
                       gang: GangClient = Depends(get_gang)) -> dict[str, Any]:
    target = await jobs.call("resolve_weights", job_id=req.job_id, checkpoint=req.checkpoint)
    info = await gang.reload_weights(target["path"])
    return {"job_id": target["job_id"], "checkpoint": target["path"],
            "weights_version": info.get("weights_version"), "gang": info}
