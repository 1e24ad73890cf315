"""What crosses between a training run's actor (service.training.run) and its workers
(service.training.runner): torch-free, so the run actor imports it without torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.config.tunables import Tunables
from service.training.run_snapshot import EpochEntry
from service.training.spec import JobSpec


@dataclass(frozen=True)
class WorkerLoop:
    """Every worker's share of a run: the job (its id names the run's checkpoints) and its
    spec, the run actor to report to, where its uploaded dataset and its init_from weights are
    (artifact keys), and the app's tunables."""

    job_id: str
    spec: JobSpec
    reporter: Any  # the run actor's ActorHandle (TrainRun's methods: worker_started, history_restored, step, epoch_done, ...)
    dataset_path: str | None  # an uploaded dataset's artifact key; None for a synthetic one
    init_key: str | None  # the job's copy of its init_from weights, loaded on a fresh start only
    tunables: Tunables


@dataclass(frozen=True)
class EpochReport:
    """One finished epoch, as rank 0 reports it to the run actor."""

    epoch: int  # the epoch just finished, 1-based
    loss: float  # mean loss over every training vector of every rank (all-reduced)
    step: int  # optimizer steps so far, this run's attempts together
    epoch_s: float  # the epoch's steps, on rank 0's clock
    eval_loss: float | None  # mean over every held-out vector; None without held-out samples
    at: float  # rank 0's wall clock (epoch seconds) when the epoch ended: the history entry's time
    checkpoint_s: float | None = None  # rank 0 writing the epoch's local files; None: no checkpoint this epoch
    checkpoint_wait_s: float | None = None  # rank 0 waiting for the previous upload
    no_checkpoint: str | None = None  # why this epoch has none (CheckpointWriter.skip_reason); None: it has one

    def entry(self) -> EpochEntry:
        """The epoch as the job's history keeps it."""
        return EpochEntry(epoch=self.epoch, loss=self.loss, eval_loss=self.eval_loss, at=self.at)
