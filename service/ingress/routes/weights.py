"""POST /weights: hot-swap the serving gang to a trained attention checkpoint.

Body: {"job_id": "job-..."} (a SUCCEEDED attention job), {"checkpoint": "<path>"} (a dense
checkpoint inside the state dir; `..` and symlinks out of it are refused) or
{"reset": true} (back to the weights the app's config declares). The JobManager resolves
the path; the GangServer copies the file into the state dir's immutable `weights/`, stages
it on every rank, records it as the app's next weights version and commits it between
requests, so in-flight requests finish on the old weights and none fails. The recorded
version is what every later bring-up serves (replica loss, restart), until the app is
started with a changed weights config.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from service.ingress.auth import require_token
from service.errors import InvalidInput
from service.ingress.deps import check_declared_length, get_gang
from service.ingress.gang_client import GangClient
from service.ingress.jobs_client import JobsClient, get_jobs

router = APIRouter(tags=["training"])


class WeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str | None = Field(None, max_length=64, description="A SUCCEEDED attention training job.")
    checkpoint: str | None = Field(None, max_length=4096, description="A dense checkpoint path inside the state dir.")
    reset: bool = Field(False, description="Serve the weights the app's config declares again (init or checkpoint).")


MAX_WEIGHTS_BODY_BYTES = 64 * 1024  # a job id or a path: never more
ROLLOUT_TIMEOUT_S = 120.0  # the other gangs follow the record within a probe interval or two


async def _small_body(request: Request) -> None:
    """413 before FastAPI parses the body, when Content-Length says it is not a small JSON object."""
    check_declared_length(request, MAX_WEIGHTS_BODY_BYTES, "the /weights body limit")


@router.post(
    "/weights",
    summary="Load a trained checkpoint into the running gang (no restart, no dropped requests)",
    dependencies=[Depends(require_token), Depends(_small_body)],
    responses={401: {"description": "missing or wrong API token"}, 404: {"description": "no such job/checkpoint"},
               413: {"description": "body over 64 KiB"},
               409: {"description": "shape mismatch, job not finished, or a rank could not stage the weights "
                                    "(nothing changed)"},
               422: {"description": "path outside the state dir, or not exactly one of job_id/checkpoint/reset"},
               503: {"description": "the gang is not ready, or a commit failed (the gang is rebuilt with the "
                                    "recorded version)"}},
)
async def load_weights(req: WeightsRequest, jobs: JobsClient = Depends(get_jobs),
                       gang: GangClient = Depends(get_gang)) -> dict[str, Any]:
    if req.reset:
        if req.job_id is not None or req.checkpoint is not None:
            raise InvalidInput("give exactly one of job_id, checkpoint or reset", code="invalid_request")
        target = {"job_id": None, "path": None}
    else:
        target = await jobs.call("resolve_weights", job_id=req.job_id, checkpoint=req.checkpoint)
    # One gang swaps and records the new version; every other gang of the app follows the
    # record within a few seconds (each swap atomic); the reply reports where each one is.
    info = await gang.reload_weights(target["path"], target["job_id"])
    version = int(info.get("weights_version") or 0)
    rolled_out, gangs = await gang.wait_rollout(version, timeout_s=ROLLOUT_TIMEOUT_S)
    return {"job_id": target["job_id"], "checkpoint": target["path"], "weights_version": version,
            "rolled_out": rolled_out, "gangs": gangs, "gang": info}
