"""A job's `init_from`: resolve it at submit, check its shape, keep the job's own copy.

    {"weights_version": N}        a recorded served weights version of this app
    {"weights_version": "current"} the newest recorded version (the one in force), resolved
                                   to its number at submit
    {"job_id": "job-..."}         that SUCCEEDED job's final checkpoint

The weights are copied at submit to `runs/<job>/init.safetensors` (the job's run dir, so
deleting the job removes it): a resume after a restart starts from the same weights even if
the source job was deleted or a newer version served since. A version the app generated
from its config (`init`, no checkpoint file) is generated again and checked against the
recorded sha256 (the app's own model: for a transformer app, the job's model must be the
app's architecture, checked before anything is generated). Which version is meant and its
weights: service.weights.targets; the shape check and the job's copy: here.

Errors (nothing recorded, nothing copied): an unknown version or job → 422
`init_from_not_found`; a job that has not SUCCEEDED → 409 `init_from_not_ready`; another
model shape → 422 `init_from_mismatch` naming both shapes (and each differing value).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config.builder_args import ModelConfig
from service.contract.errors import Conflict, ErrorCode, InvalidInput
from service.weights.record import WeightsRecord
from service.weights.targets import Architecture, find_version, served_architecture, version_file
from service.state import artifacts
from service.training.checkpoints import Shapes, fit_problems, read_architecture, spec_architecture
from service.training.spec import InitFrom, ModelSpecT
from service.training.status import JobStatus
from service.training.store import JobStore

INIT_FILE = "init.safetensors"


def init_key(job_id: str) -> str:
    """Where a job's copy of its init_from weights lives (inside its run dir)."""
    return f"runs/{job_id}/{INIT_FILE}"


@dataclass(frozen=True)
class Resolved:
    """What a job starts from: `record` (the job record's `init_from`) and a local file
    holding the weights (`local`; `temp` when it was generated and must be removed)."""

    record: dict[str, Any]
    local: Path
    temp: bool = False

    def copy_to(self, store: artifacts.ArtifactStore, job_id: str) -> str:
        """Put the weights at init_key(job_id); returns the key."""
        key = init_key(job_id)
        store.put_file(key, self.local)
        return key

    def cleanup(self) -> None:
        if self.temp:
            self.local.unlink(missing_ok=True)


def _check_fits(what: str, found: Architecture, tensors: Shapes | None, model: ModelSpecT) -> None:
    """422 init_from_mismatch unless the weights (their architecture; `tensors`: their shapes,
    None when only the architecture is known yet) fit the job's model."""
    problems = fit_problems(model, found, tensors) if tensors is not None else \
        found.differences(spec_architecture(model))
    if problems:
        raise InvalidInput(
            f"init_from {what} holds a model of another shape: {found.describe()}; this job's model is "
            f"{spec_architecture(model).describe()} ({'; '.join(problems)})", code=ErrorCode.INIT_FROM_MISMATCH)


def _check_file(what: str, local: Path, model: ModelSpecT) -> None:
    _check_fits(what, *read_architecture(local), model)


def resolve(init: InitFrom, model: ModelSpecT, *, jobs: JobStore, store: artifacts.ArtifactStore,
            weights: WeightsRecord | None, app: str | None, app_model: ModelConfig | None) -> Resolved:
    """Resolve and check `init` for a job of `model` (blocking: store and database reads).
    Raises the errors of the module docstring; StateUnavailable / StorageUnavailable (503)."""
    if init.job_id is not None:
        source = jobs.get_job(init.job_id, with_history=False)
        if source is None:
            raise InvalidInput(f"init_from job {init.job_id!r} does not exist (see GET /train)",
                               code=ErrorCode.INIT_FROM_NOT_FOUND)
        if source.status != JobStatus.SUCCEEDED or not source.checkpoint:
            raise Conflict(f"init_from job {init.job_id} has no final checkpoint: it is {source.status}"
                           + (" (wait until it SUCCEEDED)" if source.active else ""), code=ErrorCode.INIT_FROM_NOT_READY)
        try:
            local, sha = store.fetch(source.checkpoint["path"])
        except FileNotFoundError:
            raise Conflict(f"init_from job {init.job_id}: its final checkpoint {source.checkpoint['path']} is gone "
                           f"from {store.url}", code=ErrorCode.INIT_FROM_NOT_READY) from None
        _check_file(f"job {init.job_id}", local, model)
        return Resolved({"job_id": init.job_id, "sha256": sha}, local)

    version = find_version(init.weights_version, weights, app)
    what = f"weights version {version.version}"
    record = {"weights_version": version.version, "sha256": version.sha256, "source": version.source}
    if init.weights_version == "current":
        record["requested"] = "current"
    if version.checkpoint is not None:
        local = version_file(version, store)  # verified against the record
        _check_file(what, local, model)
        return Resolved(record, local)
    # Generated by the app's `init`: the same config generates the same tensors (checked).
    # Imported here, the one step of the JobManager that needs torch: its process loads none
    # otherwise (tests/test_layout.py).
    from service.weights.declared import save_generated

    if app_model is not None and (served := served_architecture(app_model)) is not None:
        # Before generating: a transformer app's weights are not small.
        _check_fits(f"{what} (the app's {app_model.kind})", served, None, model)
    fd, name = tempfile.mkstemp(prefix="gangserve-init-", suffix=".safetensors")
    os.close(fd)
    try:
        save_generated(version, app_model, name)  # overwrites the empty file
        _check_file(what, Path(name), model)  # a user's model: known once generated
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Resolved(record, Path(name), temp=True)
