"""Quotas of the training side: how much of the cluster and the state dir jobs and datasets
may hold. Each limit is a builder argument with a default (`service.config.builder_args.TrainingLimits`);
hitting one is a 4xx that names it.

Two kinds of refusal:
- 429 `quota_exceeded`: the request is fine on its own, but what is held now (active jobs,
  their workers and GPUs, stored datasets) leaves no room for it. It fits once jobs end or
  are deleted (`DELETE /train/{id}`, `DELETE /datasets/{id}`); no `Retry-After`, because
  waiting alone does not free anything.
- 422 `over_limit`: the request alone exceeds a limit (a job asking for more workers than
  `max_training_workers`, a `max_runtime_s` above the service's, a dataset longer than
  `max_seq_len`): it can never be admitted as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

from service.config.builder_args import TrainingLimits
from service.contract.errors import ErrorCode, GangServeError, InvalidInput


class QuotaExceeded(GangServeError):
    """What is held now leaves no room for the request; it fits once something is freed."""

    status, code = 429, ErrorCode.QUOTA_EXCEEDED


class OverLimit(InvalidInput):
    """The request on its own exceeds a configured limit."""

    code = ErrorCode.OVER_LIMIT


@dataclass(frozen=True)
class ActiveUsage:
    """What the active (PENDING + RUNNING) jobs hold, read in the admitting transaction."""

    jobs: int
    workers: int
    gpus: int


def check_job_alone(limits: TrainingLimits, world_size: int, use_gpu: bool, max_runtime_s: float | None) -> None:
    """422 over_limit if the job could never be admitted, whatever else runs."""
    if world_size > limits.max_training_workers:
        raise OverLimit(
            f"the job asks for {world_size} worker(s); max_training_workers is {limits.max_training_workers}"
        )
    if use_gpu and world_size > limits.max_training_gpus:
        raise OverLimit(
            f"the job asks for {world_size} GPU worker(s); max_training_gpus is {limits.max_training_gpus}"
        )
    if max_runtime_s is not None and max_runtime_s > limits.max_runtime_s:
        raise OverLimit(
            f"the job's max_runtime_s is {max_runtime_s:g}; the service's max_runtime_s is {limits.max_runtime_s:g}"
        )


def check_job_fits(limits: TrainingLimits, usage: ActiveUsage, world_size: int, use_gpu: bool) -> None:
    """429 quota_exceeded if the job does not fit next to the active ones."""
    hint = "; it fits once active jobs end (POST /train/{id}/cancel or DELETE /train/{id} frees them)"
    if usage.jobs + 1 > limits.max_active_jobs:
        raise QuotaExceeded(
            f"{usage.jobs} job(s) are PENDING or RUNNING; max_active_jobs is {limits.max_active_jobs}" + hint
        )
    if usage.workers + world_size > limits.max_training_workers:
        raise QuotaExceeded(
            f"active jobs hold {usage.workers} worker(s), this job needs {world_size} more; "
            f"max_training_workers is {limits.max_training_workers}" + hint
        )
    gpus = world_size if use_gpu else 0
    if gpus and usage.gpus + gpus > limits.max_training_gpus:
        raise QuotaExceeded(
            f"active jobs hold {usage.gpus} GPU worker(s), this job needs {gpus} more; "
            f"max_training_gpus is {limits.max_training_gpus}" + hint
        )


def check_dataset_alone(limits: TrainingLimits, max_seq_len: int, seq_len: int | None, nbytes: int) -> None:
    """422 over_limit if this dataset could never be stored."""
    if seq_len is not None and seq_len > max_seq_len:
        raise OverLimit(
            f"the dataset's sequence length is {seq_len}; max_seq_len is {max_seq_len} (the same limit as serving)"
        )
    if nbytes > limits.max_dataset_bytes:
        raise OverLimit(
            f"the dataset takes {nbytes} bytes stored (float32); max_dataset_bytes is {limits.max_dataset_bytes}"
        )


def check_dataset_fits(limits: TrainingLimits, count: int, total_bytes: int, nbytes: int) -> None:
    """429 quota_exceeded if the dataset does not fit next to the stored ones."""
    hint = "; delete datasets with DELETE /datasets/{id} to make room"
    if count + 1 > limits.max_datasets:
        raise QuotaExceeded(f"{count} dataset(s) are stored; max_datasets is {limits.max_datasets}" + hint)
    if total_bytes + nbytes > limits.max_dataset_bytes:
        raise QuotaExceeded(
            f"stored datasets take {total_bytes} bytes, this one {nbytes} more; "
            f"max_dataset_bytes is {limits.max_dataset_bytes}" + hint
        )
