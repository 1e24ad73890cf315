"""/weights: what the gangs serve, from which recorded version, and how to change it.

`POST /weights` body, exactly one of:
- {"job_id": "job-..."} (a SUCCEEDED attention job), optionally with "max_eval_loss": x, the
  promotion gate (service.weights.gate: 409 `eval_gate` unless the job's final eval loss
  is known and at most x);
- {"checkpoint": "<path>"} (a dense checkpoint inside the state dir; `..` and symlinks out
  of it are refused);
- {"version": N} (serve recorded version N again: a rollback, recorded as a new version
  with `rollback_of = N`);
- {"reset": true} (back to the weights the app's config declares).

This route picks the target: the JobManager resolves a job's or a path's file (and the
eval gate reads the job), then one gang swaps to it and the route waits for the others.
The rollout itself is service.weights.rollout: the copy into the immutable `weights/`, the
stage on every rank, the Controller's record of the app's next weights version, the commit
between requests (in-flight requests finish on the old weights and none fails), and the
other gangs following the record. The recorded version is what every later bring-up serves
(replica loss, restart), until the app is started with a changed weights config.
`GET /weights` lists the recorded versions (service.weights.record).
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from service.contract.errors import ErrorCode, InvalidInput
from service.contract.gang_status import dump
from service.ingress.auth import require_token
from service.ingress.deps import Weights, check_declared_length, get_fleet, get_weights
from service.ingress.fleet_client import FleetClient
from service.ingress.jobs_client import JobsClient, get_jobs
from service.ingress.schemas import AUTH_RESPONSES, ErrorBody
from service.weights.gate import check_eval_gate, job_eval_loss
from service.weights.served import ServedWeights
from service.weights.rollout import wait_for_gangs

router = APIRouter(tags=["training"])


class WeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str | None = Field(None, max_length=64, description="A SUCCEEDED attention training job.")
    checkpoint: str | None = Field(None, max_length=4096, description="A dense checkpoint path inside the state dir.")
    version: int | None = Field(None, ge=1, le=2**62, description="A recorded weights version to serve again "
                                                                  "(GET /weights lists them).")
    reset: bool = Field(False, description="Serve the weights the app's config declares again (init or checkpoint).")
    max_eval_loss: float | None = Field(
        None, allow_inf_nan=False,
        description="With job_id only: refuse (409 eval_gate) unless the job's final eval loss is at most this.")


class WeightsVersion(BaseModel):
    """One recorded weights version of the app."""

    version: int = Field(description="The app's weights version (only ever grows).")
    source: str = Field(description="`config` (the app's declared weights), `swap` (POST /weights with a job or "
                                    "checkpoint) or `rollback of N` (POST /weights {\"version\": N}).")
    description: str = Field(description="What the weights are, e.g. `job job-...`, `init=seed`.")
    job_id: str | None = Field(description="The training job the weights came from, if any.")
    sha256: str = Field(description="sha256 of the checkpoint file (init weights: of the dense tensors).")
    eval_loss: float | None = Field(description="The job's final held-out loss when it was promoted; null without one.")
    created_at: str = Field(description="When the version was recorded (ISO 8601, UTC).")
    current: bool = Field(description="The version in force: every gang serves it (or is moving to it).")
    superseded: bool = Field(description="A later changed app config won over this version.")
    rollback_of: int | None = Field(description="The version this one served again (rollbacks only).")


class WeightsVersions(BaseModel):
    versions: list[WeightsVersion] = Field(description="Newest first, at most `limit`.")
    total: int = Field(description="Versions recorded for this app.")


MAX_WEIGHTS_BODY_BYTES = 64 * 1024  # a job id or a path: never more


async def _small_body(request: Request) -> None:
    """413 before FastAPI parses the body, when Content-Length says it is not a small JSON object."""
    check_declared_length(request, MAX_WEIGHTS_BODY_BYTES, "the /weights body limit")


def listed(weights: ServedWeights, current: bool) -> WeightsVersion:
    source = f"rollback of {weights.rollback_of}" if weights.rollback_of is not None else weights.source
    return WeightsVersion(
        version=weights.version, source=source, description=weights.description, job_id=weights.job_id,
        sha256=weights.sha256, eval_loss=weights.eval_loss,
        created_at=datetime.fromtimestamp(weights.recorded_at, timezone.utc).isoformat(timespec="milliseconds"),
        current=current, superseded=weights.superseded_at is not None, rollback_of=weights.rollback_of,
    )


@router.get(
    "/weights",
    summary="The recorded weights versions of this app, newest first; `current` is the one in force",
    dependencies=[Depends(require_token)],
    response_model=WeightsVersions,
    responses={**AUTH_RESPONSES, 503: {"model": ErrorBody, "description": "the Controller or the state database "
                                                                          "cannot answer; has Retry-After"}},
)
async def list_weights(limit: int = Query(100, ge=1, le=1000, description="At most this many, newest first."),
                       fleet: FleetClient = Depends(get_fleet)) -> WeightsVersions:
    history: list[ServedWeights] = await fleet.weights_history()
    newest = history[-1].version if history else None
    rows = [listed(w, w.version == newest) for w in reversed(history[-limit:])]
    return WeightsVersions(versions=rows, total=len(history))


def _one_target(req: WeightsRequest) -> str:
    given = [name for name, value in (("job_id", req.job_id), ("checkpoint", req.checkpoint),
                                      ("version", req.version), ("reset", req.reset or None)) if value is not None]
    if len(given) != 1:
        raise InvalidInput(f"give exactly one of job_id, checkpoint, version or reset; got "
                           f"{', '.join(given) if given else 'none'}", code=ErrorCode.INVALID_REQUEST)
    if req.max_eval_loss is not None and given[0] != "job_id":
        raise InvalidInput(f"max_eval_loss gates a job's promotion: it needs job_id, got {given[0]}",
                           code=ErrorCode.INVALID_REQUEST)
    return given[0]


@router.post(
    "/weights",
    summary="Serve a trained checkpoint or a recorded version (no restart, no dropped requests)",
    dependencies=[Depends(require_token), Depends(_small_body)],
    responses={401: {"description": "missing or wrong API token"},
               404: {"description": "no such job, checkpoint or weights version"},
               413: {"description": "body over 64 KiB"},
               409: {"description": "shape mismatch, job not finished, eval gate (`eval_gate`: the job's eval loss "
                                    "is above max_eval_loss, or it has none), a recorded version that cannot be "
                                    "served again, or a rank could not stage the weights (nothing changed)"},
               422: {"description": "path outside the state dir, or not exactly one of "
                                    "job_id/checkpoint/version/reset"},
               503: {"description": "the gang is not ready, or a commit failed (the gang is rebuilt with the "
                                    "recorded version)"}},
)
async def load_weights(req: WeightsRequest, jobs: JobsClient = Depends(get_jobs),
                       gang: Weights = Depends(get_weights), fleet: FleetClient = Depends(get_fleet)) -> dict[str, Any]:
    what = _one_target(req)
    target: dict[str, Any] = {"job_id": None, "path": None}
    if what == "version":
        info = await gang.rollback_weights(req.version)  # type: ignore[arg-type]
    elif what == "reset":
        info = await gang.reload_weights(None)
    else:
        target = await jobs.call("resolve_weights", job_id=req.job_id, checkpoint=req.checkpoint)
        eval_loss = None
        if req.job_id is not None:
            job = await jobs.call("get_job", req.job_id)
            check_eval_gate(job, req.max_eval_loss)  # before anything is copied or staged
            eval_loss = job_eval_loss(job)
        info = await gang.reload_weights(target["path"], target["job_id"], eval_loss)
    # One gang swaps and records the new version; every other gang of the app follows the
    # record within a few seconds (each swap atomic); the reply reports where each one is.
    version = info.weights_version
    rolled_out, gangs = await wait_for_gangs(fleet.watch, version, timeout_s=fleet.tunables.ingress.rollout_timeout_s)
    return {"job_id": target["job_id"], "checkpoint": target["path"], "weights_version": version,
            "rollback_of": req.version, "rolled_out": rolled_out, "gangs": gangs, "gang": dump(info)}
