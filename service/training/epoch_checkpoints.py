"""A run's epoch checkpoints in the artifact store: where rank 0 writes them, which one a
worker group resumes from, and how many are kept. Torch-free (the run actor reads the
pointer; the workers write and read the files, service.training.runner).

    runs/<job>/epoch-000007/model.safetensors   the model (save_model's format: the serving format)
    runs/<job>/epoch-000007/train_state.pt      epoch, step, optimizer state, the history up to it
    runs/<job>/latest.json                      {"epoch": 7}: the newest complete checkpoint

The pointer is written after both files of its epoch, in one atomic write (a local temp file
and a rename; one PUT on S3), so it only ever names a complete checkpoint: a run killed in
the middle of an upload resumes from the one before. It is what every worker group starts
from, whether it replaces one that failed (the same run actor) or continues a run that died
with the service (a new run actor of the same job): one source of truth, in the store, that
outlives every process.

KEEP checkpoints stay: once a pointer names epoch e, the directory of the checkpoint KEEP
registrations before it is deleted (a reader that read the previous pointer still finds its
files). A directory an upload was writing when its run died is never registered; it goes
with the run's prefix when the job is deleted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from service.state.artifacts import ArtifactStore
from service.training.checkpoints import MODEL_FILE

TRAIN_STATE_FILE = "train_state.pt"
LATEST_FILE = "latest.json"
KEEP = 2


def run_prefix(job_id: str) -> str:
    """The run's files, as an artifact key prefix: its epoch checkpoints, the pointer, result.json."""
    return f"runs/{job_id}"


@dataclass(frozen=True)
class EpochCheckpoint:
    """The checkpoint written after `epoch` (1-based) of job `job_id`'s run."""

    job_id: str
    epoch: int

    @property
    def prefix(self) -> str:
        return f"{run_prefix(self.job_id)}/epoch-{self.epoch:06d}"

    @property
    def model_key(self) -> str:
        return f"{self.prefix}/{MODEL_FILE}"

    @property
    def state_key(self) -> str:
        return f"{self.prefix}/{TRAIN_STATE_FILE}"


def latest(store: ArtifactStore, job_id: str) -> EpochCheckpoint | None:
    """The newest registered checkpoint of the job's run; None before the first (or when the
    pointer is unreadable: a store written by hand; a resumed run then starts over)."""
    try:
        doc = json.loads(store.read_bytes(f"{run_prefix(job_id)}/{LATEST_FILE}"))
        epoch = int(doc["epoch"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return EpochCheckpoint(job_id, epoch) if epoch >= 1 else None


def register(store: ArtifactStore, checkpoint: EpochCheckpoint, registered: list[EpochCheckpoint]) -> None:
    """Point the run at `checkpoint` (its files already written), then delete what falls out
    of the KEEP newest. `registered`: the writer's own registrations so far, oldest first
    (the one it resumed from first); appended to."""
    store.write_bytes(f"{run_prefix(checkpoint.job_id)}/{LATEST_FILE}",
                      json.dumps({"epoch": checkpoint.epoch}).encode())
    registered.append(checkpoint)
    while len(registered) > KEEP:
        store.delete_prefix(registered.pop(0).prefix)
