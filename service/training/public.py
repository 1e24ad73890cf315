"""The public shape of a training job: the response models of GET /train/{id}, GET /train
and POST /train/{id}/cancel (OpenAPI documents them; FastAPI checks every answer against
them).

The dicts are built by `JobRecord.to_public` (service.training.store) in the JobManager and
cross Ray as plain dicts; these models describe them and add nothing. Every model allows
extra keys, so a key added to `to_public` reaches clients (the status page, the CLI) before
it is documented here; tests/test_job_status.py checks that every key is documented and that
a record survives the model unchanged. Plain pydantic, no imports beyond the status table:
the ingress imports this module (tests/test_layout.py ALLOWED_SIDEWAYS).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.training.status import JobStatus


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class HistoryEntry(_Open):
    """One finished epoch (a resumed attempt re-reports from its checkpoint on: the list is
    always the run's own history). `at` (unix seconds of the report) is present when known."""

    epoch: int = Field(description="1-based epoch number.")
    loss: float | None = Field(None, description="Mean training loss of the epoch.")
    eval_loss: float | None = Field(None, description="Held-out loss after the epoch; null without validation.")


class Checkpoint(_Open):
    """The final checkpoint of a SUCCEEDED job."""

    path: str = Field(description="Its artifact key, relative to the storage root (old records: an absolute path).")
    url: str = Field(description="Where to download it: /train/{id}/checkpoint.")
    format: str = Field(description="dense-attention (the contract's attention format) or linear.")
    bytes: int | None = Field(None, description="Size of the safetensors file (absent in records older than "
                                                "the artifact store).")


class JobView(_Open):
    """One training job (POST /train answers the same shape, 202)."""

    id: str = Field(description="job-<hex>; also in the Location of POST /train.")
    status: JobStatus = Field(description="PENDING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED (PENDING may "
                                          "end directly); the last three are terminal.")
    spec: dict[str, Any] = Field(description="The validated job spec, defaults filled in (see POST /train).")
    created_at: str | None = Field(description="Submission time, ISO 8601 UTC.")
    updated_at: str | None = Field(description="Last change of the record, ISO 8601 UTC.")
    started_at: str | None = Field(description="When the first worker entered the train loop; null while PENDING.")
    finished_at: str | None = Field(description="When it reached a terminal status; null while active.")
    progress: dict[str, Any] = Field(description="{epoch, epochs, step, loss}: the newest reported position.")
    history: list[HistoryEntry] = Field(description="Finished epochs, oldest first.")
    reason: str | None = Field(description="Why it waits (PENDING: the resources it waits for) or why it was "
                                           "cancelled; null otherwise.")
    error: str | None = Field(description="Why it FAILED; null otherwise.")
    checkpoint: Checkpoint | None = Field(description="The final checkpoint once SUCCEEDED; null before.")
    attempts: int = Field(description="Worker-group starts (a failed group is replaced up to spec.max_failures times).")
    workers: list[dict[str, Any]] = Field(description="The current attempt's workers: {rank, pid, node_id, "
                                                      "node_ip, iface, attempt}.")
    init_from: dict[str, Any] | None = Field(description="What the job started from, resolved; null: random.")
    final_eval_loss: float | None = Field(description="The last epoch's eval_loss once SUCCEEDED; else null.")
    resumes: int = Field(description="Times its run was started again after it died with the service.")
    resumed_from_epoch: int | None = Field(description="The epoch checkpoint the newest attempt resumed from.")


class JobList(_Open):
    """A page of jobs, newest first."""

    jobs: list[JobView] = Field(description="At most `limit` jobs.")
    next: str | None = Field(description="The `cursor` of the next page; null on the last page.")
