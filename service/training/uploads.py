"""Uploaded datasets: the /datasets commands and what a job's spec needs of its dataset.

`Datasets` validates an upload (service.training.datasets), writes it to the artifact store
(`datasets/<id>.safetensors`) and records it in the job store, counting the stored datasets
against the quotas (service.training.limits) before writing anything and again in the
insert's own transaction, so concurrent uploads cannot overshoot a limit. A dataset an
active job trains on cannot be deleted (409 `dataset_in_use`). Part of
service.training.jobs.Jobs, which answers the ingress's calls.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from safetensors.numpy import save as st_save

from service.contract.errors import BadRequest, Conflict, ErrorCode, InvalidInput, NotFound
from service.state.artifacts import ArtifactStore, StorageUnavailable
from service.training.dataset_files import DatasetError, DatasetInfo, MalformedDataset, check_compatible, parse_upload
from service.config.builder_args import TrainingLimits
from service.training.limits import check_dataset_alone, check_dataset_fits
from service.training.spec import JobSpec, UploadedDataset
from service.training.store import DatasetInUse, JobStore

log = logging.getLogger("gangserve.training")


class Datasets:
    """The uploaded datasets of one app: in `store` (records) and `artifacts` (files)."""

    def __init__(self, store: JobStore, artifacts: ArtifactStore, limits: TrainingLimits, max_seq_len: int) -> None:
        """`max_seq_len`: the serving limit, applied to uploaded attention datasets too."""
        self._store = store
        self._artifacts = artifacts
        self._limits = limits
        self._max_seq_len = max_seq_len

    async def upload(self, body: bytes) -> dict[str, Any]:
        """Store a safetensors body as a dataset; its public record. 400 unparsable, 422
        invalid or alone over a limit, 429 no room next to the stored ones."""
        try:
            info, tensors = await asyncio.to_thread(parse_upload, body)
        except MalformedDataset as exc:
            raise BadRequest(str(exc)) from None
        except DatasetError as exc:
            raise InvalidInput(str(exc), code=ErrorCode.INVALID_DATASET) from None
        seq_len = info.inputs_shape[1] if info.kind == "attention" else None
        estimate = sum(int(t.nbytes) for t in tensors.values())  # the stored file is a header more
        check_dataset_alone(self._limits, self._max_seq_len, seq_len, estimate)
        count, total = await asyncio.to_thread(self._store.dataset_usage)
        check_dataset_fits(self._limits, count, total, estimate)  # before writing anything
        dataset_id = f"ds-{uuid.uuid4().hex[:12]}"
        key = f"datasets/{dataset_id}.safetensors"
        data = await asyncio.to_thread(st_save, tensors)
        nbytes = len(data)
        check_dataset_alone(self._limits, self._max_seq_len, seq_len, nbytes)

        def admit(count: int, total: int) -> None:  # again, atomically with the insert
            check_dataset_fits(self._limits, count, total, nbytes)

        await asyncio.to_thread(self._artifacts.write_bytes, key, data)  # atomic; 503 if the store is down
        try:
            return await asyncio.to_thread(self._store.add_dataset, dataset_id, info.to_dict(), key, nbytes, admit)
        except BaseException:
            await asyncio.to_thread(self._delete_quietly, key)
            raise

    async def delete(self, dataset_id: str) -> dict[str, Any]:
        """Remove an uploaded dataset (record and file). 409 while an active job trains on it;
        503 (nothing removed) while the artifact store cannot be reached."""
        await asyncio.to_thread(self._artifacts.check_reachable)  # before the record goes
        try:
            public, path = await asyncio.to_thread(self._store.delete_dataset, dataset_id)
        except KeyError:
            raise NotFound(f"no dataset {dataset_id!r} (see GET /datasets)", code=ErrorCode.DATASET_NOT_FOUND) from None
        except DatasetInUse as exc:
            raise Conflict(
                f"dataset {dataset_id} is used by active job(s) {', '.join(exc.job_ids)}; cancel or delete them first",
                code=ErrorCode.DATASET_IN_USE,
            ) from None
        try:
            # Only objects inside the store's datasets/ are ever removed.
            key = self._artifacts.key_of(path)
            if not key.startswith("datasets/"):
                raise ValueError(f"{key!r} is not under datasets/")
        except ValueError:
            log.warning("dataset %s recorded a path outside the artifact store's datasets/ (%s); left it",
                        dataset_id, path)
        else:
            await asyncio.to_thread(self._delete_quietly, key)
        return {"id": dataset_id, "deleted": True, "freed_bytes": public["bytes"]}

    async def list(self) -> dict[str, Any]:
        return {"datasets": await asyncio.to_thread(self._store.list_datasets)}

    async def for_job(self, spec: JobSpec) -> str | None:
        """The dataset path a submitted job's workers read (None: synthetic data), after
        checking it fits the job: 422 `dataset_not_found`, `dataset_mismatch`, or `invalid_spec`
        (a validation_fraction next to the dataset's own validation set)."""
        if not isinstance(spec.dataset, UploadedDataset):
            return None
        found = await asyncio.to_thread(self._store.get_dataset, spec.dataset.id)
        if found is None:
            raise InvalidInput(f"dataset {spec.dataset.id!r} does not exist (see GET /datasets)",
                               code=ErrorCode.DATASET_NOT_FOUND)
        public, recorded = found
        info = DatasetInfo(**{k: public[k] for k in ("kind", "samples", "inputs_shape", "targets_shape")})
        try:
            check_compatible(spec.model, info)
        except DatasetError as exc:
            raise InvalidInput(str(exc), code=ErrorCode.DATASET_MISMATCH) from None
        if public.get("validation_samples") and spec.dataset.validation_fraction:
            raise InvalidInput(
                f"dataset {spec.dataset.id} has its own validation set ({public['validation_samples']} samples "
                f"in val_inputs/val_targets); validation_fraction={spec.dataset.validation_fraction} would hold "
                "out training samples too: leave it unset or 0", code=ErrorCode.INVALID_SPEC)
        return self._ref(recorded)

    async def path_of(self, dataset_id: str) -> str | None:
        """The path the workers read for a recorded dataset, or None if it is gone."""
        found = await asyncio.to_thread(self._store.get_dataset, dataset_id)
        return None if found is None else self._ref(found[1])

    def _ref(self, recorded: str) -> str:
        """A dataset record's path as the training workers read it: its key (rows from
        before keys hold an absolute path inside the state dir), else the path itself."""
        try:
            return self._artifacts.key_of(recorded)
        except ValueError:
            return recorded

    def _delete_quietly(self, key: str) -> None:
        try:
            self._artifacts.delete(key)
        except (StorageUnavailable, OSError) as exc:
            log.warning("could not remove %s from %s: %s", key, self._artifacts.url, exc)
