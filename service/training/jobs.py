"""The training jobs' owner: commands, datasets, and the poll loop over the run actors.

`Jobs` validates and admits jobs (fail-fast placement check), launches each run as a
detached `TrainRun` actor, polls the runs and is the only writer of their records, and
answers the ingress's job, dataset and checkpoint questions. It runs inside the JobManager
Serve deployment (service.deployments.job_manager, a shell over this class); the ingress
never creates actors, it only calls that deployment.

Life of a job: PENDING (record written, run actor created, Ray Train waiting for its
workers; `reason` says what it waits for) -> RUNNING (rank 0 entered the train loop) ->
SUCCEEDED | FAILED | CANCELLED (the allowed moves: service.training.status, which the
store's writes obey). A PENDING job that outlives `schedule_timeout_s`, or that
the cluster can no longer ever hold (a node left), is stopped and FAILED with the numbers;
so is any job past its `max_runtime_s` (wall clock since submission).

Quotas (`TrainingLimits`): admission counts the active jobs, their workers and GPUs in the
same transaction that inserts the job, and dataset uploads count the stored datasets the
same way, so concurrent requests cannot overshoot a limit. `delete_job` and
`delete_dataset` give the space back.

The state database (service.state.db, `GANGSERVE_DATABASE_URL`) may be unreachable: at
start-up the replica fails with StateUnavailable naming the redacted URL; mid-run, requests
that need it answer 503 `state_unavailable`, and the poll loop keeps going. A write the
poller must not lose (a job FAILED after its run was stopped, the outcome of a run that is
gone, a manager log line) is kept in order and retried every round until the database is
back (service.training.kept_writes); progress, history and log lines of live runs are re-read from the
run and written again by the next poll anyway. Restarting the replica cannot bring a
database back, so those failures do not count towards `check_health`.

Files (datasets, run dirs, final checkpoints) live in the artifact store
(service.state.artifacts: the state dir, or object storage); records hold their keys.

Runs that die with the service resume: when a job is active but its run actor is gone (a
head restart with the state kept, the actor's node lost) and its run left no result.json,
the manager that finds it (at adoption, or polling it) starts a new run of the same job,
which Ray Train resumes from the run dir's last registered epoch checkpoint (see
service.training.run). At most MAX_RESUMES times per job (`resumes` in its record); then it
FAILS naming the count. A cancelled or deleted job is never resumed (only active records
are). `init_from` is resolved and copied at submit (service.training.init_from).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import ray
from pydantic import ValidationError
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from safetensors.numpy import save as st_save

from service.config import ModelConfig, ServingConfig
from service.errors import BadRequest, Conflict, InvalidInput, NotFound, describe_validation_errors
from service.metrics.process import enable_ray_metrics, process_metrics
from service.metrics.recorders import EpochClock, training_snapshot
from service.state import artifacts
from service.state.db import StateUnavailable, database_url
from service.state.paths import state_dir
from service.cluster.placement import cluster_snapshot
from service.training import resources
from service.weights.record import WeightsRecord
from service.training import init_from
from service.training.datasets import DatasetError, DatasetInfo, MalformedDataset, check_compatible, parse_upload
from service.training.limits import (
    ActiveUsage,
    TrainingLimits,
    check_dataset_alone,
    check_dataset_fits,
    check_job_alone,
    check_job_fits,
)
from service.training.run import (
    RUN_NAMESPACE,
    TrainRun,
    final_checkpoint_key,
    read_result,
    run_actor_name,
    run_prefix,
)
from service.training.spec import AttentionModel, JobSpec, UploadedDataset
from service.training.status import TERMINAL, JobStatus, can_move
from service.training.kept_writes import KeptWrites
from service.training.store import DatasetInUse, JobRecord, JobStore, iso
from service.tunables import TUNABLES

log = logging.getLogger("gangserve.training")

# The poll loop's timing and budgets (service.tunables says why each value).
POLL_INTERVAL_S = TUNABLES.training.poll_interval_s
HEARTBEAT_INTERVAL_S = TUNABLES.training.heartbeat_interval_s
OWNER_STALE_S = TUNABLES.training.owner_stale_s
ADOPT_INTERVAL_S = TUNABLES.training.adopt_interval_s
SNAPSHOT_TIMEOUT_S = TUNABLES.training.snapshot_timeout_s
MAX_MISSED_POLLS = TUNABLES.training.max_missed_polls
PENDING_REASON_INTERVAL_S = TUNABLES.training.pending_reason_interval_s
MAX_POLL_FAILURES = TUNABLES.training.max_poll_failures
LATE_SWEEP_S = TUNABLES.training.late_sweep_s
MAX_RESUMES = TUNABLES.training.max_resumes

_RemoteTrainRun = ray.remote(TrainRun)
T = TypeVar("T")


@dataclass
class _Run:
    handle: Any
    log_seq: int = 0
    history_seq: int = 0
    missed_polls: int = 0
    reason_checked_at: float = 0.0


class Jobs:
    """Owns the job store and the run actors; every wait is bounded. `start` opens it."""

    async def start(self, limits: dict[str, Any] | None = None, max_seq_len: int | None = None,
                    model: dict[str, Any] | None = None, *, app: str) -> None:
        """`limits`: TrainingLimits fields (builder arguments; defaults otherwise).
        `max_seq_len`: the serving limit, applied to uploaded attention datasets too.
        `model`: the app's ModelConfig, to regenerate a served version its `init` made
        (init_from a version without a checkpoint file). `app`: the Serve application's
        name (its served-weights record)."""
        self._limits = TrainingLimits.model_validate(limits or {})
        self._max_seq_len = int(max_seq_len or ServingConfig.model_fields["max_seq_len"].default)
        self._state_dir = state_dir()
        # Fails the start (redacted URL and why) while the artifact store cannot be used.
        self._artifacts = await asyncio.to_thread(artifacts.check_reachable)
        self._store = JobStore(database_url(self._state_dir))  # StateUnavailable: unreachable
        # The app's served weights record, read only (init_from a weights version).
        self._weights = WeightsRecord(self._state_dir, self._store.database)
        self._app = app
        self._app_model = ModelConfig.model_validate(model) if model else None
        self._id = f"mgr-{uuid.uuid4().hex[:12]}"
        self._node_id = ray.get_runtime_context().get_node_id()
        self._runs: dict[str, _Run] = {}
        self._sweeps: set[asyncio.Task[None]] = set()
        self._last_heartbeat = 0.0
        self._last_adopt = 0.0
        self._poll_failures = 0  # consecutive failed rounds of _poll_forever (not the database's)
        self._last_poll_error = ""
        # Writes that found the database unavailable, retried in order (service.training.kept_writes).
        self._kept = KeptWrites()
        self._state_down_since: float | None = None
        enable_ray_metrics()
        self._epochs = EpochClock(process_metrics())  # gangserve_training_epoch_seconds
        await self._io(self._store.heartbeat, self._id)
        await self._adopt()
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
        log.info("job manager %s on state dir %s, artifacts in %s", self._id, self._state_dir, self._artifacts.url)

    # ---- jobs ---------------------------------------------------------------------------

    async def submit(self, spec_doc: dict[str, Any]) -> dict[str, Any]:
        """Admit a job: 422 if invalid or infeasible; else a PENDING record and a run actor."""
        try:
            spec = JobSpec.model_validate(spec_doc)
        except ValidationError as exc:
            raise InvalidInput(f"invalid job spec: {describe_validation_errors(exc.errors())}", code="invalid_spec") from None
        check_job_alone(self._limits, spec.world_size, spec.use_gpu, spec.max_runtime_s)
        if spec.max_runtime_s is None:  # recorded with the job, so a restart keeps enforcing it
            spec = spec.model_copy(update={"max_runtime_s": self._limits.max_runtime_s})
        dataset_path = None
        if isinstance(spec.dataset, UploadedDataset):
            found = await self._io(self._store.get_dataset, spec.dataset.id)
            if found is None:
                raise InvalidInput(f"dataset {spec.dataset.id!r} does not exist (see GET /datasets)",
                                   code="dataset_not_found")
            public, dataset_path = found
            dataset_path = self._dataset_ref(dataset_path)
            info = DatasetInfo(**{k: public[k] for k in ("kind", "samples", "inputs_shape", "targets_shape")})
            try:
                check_compatible(spec.model, info)
            except DatasetError as exc:
                raise InvalidInput(str(exc), code="dataset_mismatch") from None
            if public.get("validation_samples") and spec.dataset.validation_fraction:
                raise InvalidInput(
                    f"dataset {spec.dataset.id} has its own validation set ({public['validation_samples']} samples "
                    f"in val_inputs/val_targets); validation_fraction={spec.dataset.validation_fraction} would hold "
                    "out training samples too: leave it unset or 0", code="invalid_spec")
        bundle = spec.worker_bundle()
        snapshot = await asyncio.to_thread(cluster_snapshot)  # one GCS read: totals and free
        why_not = resources.infeasible_reason(bundle, spec.world_size, snapshot.totals, spec.placement_strategy)
        if why_not:
            raise InvalidInput(why_not, code="infeasible")
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        init = None
        if spec.init_from is not None:
            resolved = await asyncio.to_thread(
                init_from.resolve, spec.init_from, spec.model, jobs=self._store, store=self._artifacts,
                weights=self._weights, app=self._app, app_model=self._app_model)
            try:
                # The job's own copy, written before its record: a restart always finds it.
                await asyncio.to_thread(resolved.copy_to, self._artifacts, job_id)
            finally:
                await asyncio.to_thread(resolved.cleanup)
            init = resolved.record
        now = time.time()
        record = JobRecord(
            id=job_id,
            status=JobStatus.PENDING,
            spec=spec.model_dump(),
            created_at=now,
            updated_at=now,
            progress={"epoch": 0, "epochs": spec.epochs, "step": 0, "loss": None},
            reason=resources.pending_reason(bundle, spec.world_size, snapshot, spec.placement_strategy),
            owner=self._id,
            init_from=init,
        )

        def admit(usage: ActiveUsage) -> None:
            check_job_fits(self._limits, usage, spec.world_size, spec.use_gpu)

        dataset_id = spec.dataset.id if isinstance(spec.dataset, UploadedDataset) else None
        try:
            await self._io(self._store.create_job, record, admit, dataset_id)
        except BaseException as exc:
            if init is not None:  # refused: nothing of the job may stay behind
                await asyncio.to_thread(self._remove_job_files, job_id)
            if isinstance(exc, LookupError):
                raise InvalidInput(f"dataset {dataset_id!r} was deleted (see GET /datasets)",
                                   code="dataset_not_found") from None
            raise
        await self._manager_log(record.id, f"submitted by {self._id}: {spec.model_dump_json()}"
                                + (f"; init_from {json.dumps(init)}" if init else ""))
        try:
            await self._launch(record, dataset_path)
        except Exception as exc:  # noqa: BLE001 - recorded, then reported
            await self._fail(record.id, f"could not start the run actor: {type(exc).__name__}: {exc}")
            raise
        return record.to_public()

    async def _launch(self, record: JobRecord, dataset_path: str | None,
                      resume: dict[str, Any] | None = None) -> None:
        """Create the job's run actor and poll it. `resume`: continue a run that died."""
        # Creating a named actor registers the name with the GCS synchronously: off the loop.
        handle = await asyncio.to_thread(_RemoteTrainRun.options(
            name=run_actor_name(record.id),
            namespace=RUN_NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            max_restarts=0,
            max_concurrency=16,
            # The Ray Train controller is placed on its driver's node; keep both where
            # the state dir is known to be mounted (a local artifact store needs it).
            scheduling_strategy=NodeAffinitySchedulingStrategy(self._node_id, soft=False),
        ).remote, record.id, record.spec, dataset_path,
            init_from.init_key(record.id) if record.init_from else None, resume)
        self._runs[record.id] = _Run(handle)

    async def get_job(self, job_id: str) -> dict[str, Any]:
        return (await self._record(job_id)).to_public()

    async def list_jobs(self, limit: int = 20, cursor: str | None = None) -> dict[str, Any]:
        """Newest first: {"jobs": [...], "next": cursor | None}."""
        if not 1 <= limit <= 200:
            raise InvalidInput(f"limit must be in 1..200, got {limit}", code="invalid_request")
        seq = None
        if cursor is not None:
            if not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 18):
                raise InvalidInput(f"cursor {cursor!r} is not one returned by GET /train", code="invalid_request")
            seq = int(cursor)
        records, nxt = await self._io(self._store.list_jobs, limit, seq)
        return {"jobs": [r.to_public() for r in records], "next": str(nxt) if nxt is not None else None}

    async def cancel(self, job_id: str) -> dict[str, Any]:
        """Stop the run (kill its actor; Ray Train's cleaner frees the workers' placement group
        within seconds) and mark it CANCELLED. 409 if it already ended."""
        record = await self._record(job_id, with_history=False)
        if not can_move(record.status, JobStatus.CANCELLED):
            raise Conflict(f"job {job_id} already ended with status {record.status}", code="job_finished")
        changed = await self._io(
            self._store.update_job, job_id, status=JobStatus.CANCELLED, finished_at=time.time(),
            reason="cancelled by request",
        )
        if not changed:  # it ended between the read and the write
            record = await self._record(job_id)
            raise Conflict(f"job {job_id} already ended with status {record.status}", code="job_finished")
        await self._manager_log(job_id, "cancelled by request; stopping the run")
        await self._kill_run(job_id)
        return await self.get_job(job_id)

    async def delete_job(self, job_id: str) -> dict[str, Any]:
        """Remove a job: cancel it if active (its workers are freed within seconds), then its
        record, history, logs, Ray Train run dir and final checkpoint. Served weights are not
        affected: POST /weights serves its own copy of a checkpoint."""
        record = await self._record(job_id, with_history=False)
        if record.active:
            await self._io(
                self._store.update_job, job_id, status=JobStatus.CANCELLED, finished_at=time.time(),
                reason="deleted by request",
            )
            await self._kill_run(job_id)
        if not await self._io(self._store.delete_job, job_id):
            raise NotFound(f"no training job {job_id!r}", code="job_not_found")
        freed = await asyncio.to_thread(self._remove_job_files, job_id)
        if record.active:
            task = asyncio.get_running_loop().create_task(self._late_sweep(job_id))
            self._sweeps.add(task)
            task.add_done_callback(self._sweeps.discard)
        log.info("deleted job %s (was %s), freed %d bytes", job_id, record.status, freed)
        return {"id": job_id, "deleted": True, "status": record.status, "freed_bytes": freed}

    def _remove_job_files(self, job_id: str) -> int:
        """Delete the run dir and final checkpoint of a job from the artifact store; bytes
        freed. A store outage leaves them (logged): the record is gone either way, and the
        late sweeps of a job deleted while active try again."""
        try:
            return self._artifacts.delete(final_checkpoint_key(job_id)) + self._artifacts.delete_prefix(run_prefix(job_id))
        except artifacts.StorageUnavailable as exc:
            log.warning("files of deleted job %s not removed: %s", job_id, exc)
            return 0

    async def _late_sweep(self, job_id: str) -> None:
        for delay in LATE_SWEEP_S:
            await asyncio.sleep(delay)
            await asyncio.to_thread(self._remove_job_files, job_id)

    async def logs(self, job_id: str, tail: int = 200) -> dict[str, Any]:
        await self._record(job_id, with_history=False)
        if not 1 <= tail <= 2000:
            raise InvalidInput(f"tail must be in 1..2000, got {tail}", code="invalid_request")
        lines = await self._io(self._store.tail_logs, job_id, tail)
        return {"id": job_id, "lines": [f"{iso(ts)} {line}" for ts, line in lines]}

    async def checkpoint_key(self, job_id: str) -> str:
        """The artifact key of a finished job's final checkpoint (GET /train/{id}/checkpoint
        streams it from the store; POST /weights copies it)."""
        record = await self._record(job_id, with_history=False)
        if record.status != JobStatus.SUCCEEDED or not record.checkpoint:
            raise Conflict(
                f"job {job_id} has no final checkpoint: status {record.status}"
                + (f" ({record.error})" if record.error else ""),
                code="no_checkpoint",
            )
        return await self._artifact_key(record.checkpoint["path"])

    async def resolve_weights(self, job_id: str | None = None, checkpoint: str | None = None) -> dict[str, Any]:
        """The dense attention checkpoint POST /weights should load: {"path" (its artifact
        key), "job_id", "embed_dim", "num_heads"}. A client-given path must be a key inside
        the artifact store (for a local store: resolve inside it, symlinks included)."""
        if (job_id is None) == (checkpoint is None):
            raise InvalidInput("give exactly one of job_id or checkpoint", code="invalid_request")
        if job_id is not None:
            record = await self._record(job_id)
            model = JobSpec.model_validate(record.spec).model
            if not isinstance(model, AttentionModel):
                raise Conflict(f"job {job_id} trained a {model.kind} model; only attention checkpoints can be served",
                               code="checkpoint_mismatch")
            key = await self.checkpoint_key(job_id)
            return {"path": key, "job_id": job_id, "embed_dim": model.embed_dim, "num_heads": model.num_heads}
        key = await self._artifact_key(checkpoint)  # type: ignore[arg-type]
        return {"path": key, "job_id": None}

    # ---- datasets -----------------------------------------------------------------------

    async def upload_dataset(self, body: bytes) -> dict[str, Any]:
        try:
            info, tensors = await asyncio.to_thread(parse_upload, body)
        except MalformedDataset as exc:
            raise BadRequest(str(exc)) from None
        except DatasetError as exc:
            raise InvalidInput(str(exc), code="invalid_dataset") from None
        seq_len = info.inputs_shape[1] if info.kind == "attention" else None
        estimate = sum(int(t.nbytes) for t in tensors.values())  # the stored file is a header more
        check_dataset_alone(self._limits, self._max_seq_len, seq_len, estimate)
        count, total = await self._io(self._store.dataset_usage)
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
            return await self._io(self._store.add_dataset, dataset_id, info.to_dict(), key, nbytes, admit)
        except BaseException:
            await asyncio.to_thread(self._delete_quietly, key)
            raise

    async def delete_dataset(self, dataset_id: str) -> dict[str, Any]:
        """Remove an uploaded dataset (record and file). 409 while an active job trains on it;
        503 (nothing removed) while the artifact store cannot be reached."""
        await asyncio.to_thread(self._artifacts.check_reachable)  # before the record goes
        try:
            public, path = await self._io(self._store.delete_dataset, dataset_id)
        except KeyError:
            raise NotFound(f"no dataset {dataset_id!r} (see GET /datasets)", code="dataset_not_found") from None
        except DatasetInUse as exc:
            raise Conflict(
                f"dataset {dataset_id} is used by active job(s) {', '.join(exc.job_ids)}; cancel or delete them first",
                code="dataset_in_use",
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

    async def list_datasets(self) -> dict[str, Any]:
        return {"datasets": await self._io(self._store.list_datasets)}

    # ---- metrics ------------------------------------------------------------------------

    async def metrics(self) -> dict[str, Any]:
        """For the ingress's /metrics: jobs per status, the last epoch loss and eval loss of
        every active job this manager runs, the epoch-time histogram (a service.metrics.process snapshot)."""
        counts = await self._io(self._store.status_counts)
        losses: dict[str, float] = {}
        eval_losses: dict[str, float] = {}
        for job_id in list(self._runs):
            record = await self._io(self._store.get_job, job_id, True)
            if record is None or not record.active or not record.history:
                continue
            last = record.history[-1]
            if last.get("loss") is not None:
                losses[job_id] = float(last["loss"])
            if last.get("eval_loss") is not None:
                eval_losses[job_id] = float(last["eval_loss"])
        return training_snapshot(tuple(s.value for s in JobStatus), counts, losses, process_metrics(),
                                 eval_losses)

    # ---- health (the deployment's Serve health check) ------------------------------------

    async def check_health(self) -> None:
        """Fails when the poll loop is dead or has failed MAX_POLL_FAILURES rounds in a row
        (jobs would then go unwatched: no progress, no runtime limit, no failure detection)."""
        if self._poller.done():
            exc = self._poller.exception() if not self._poller.cancelled() else None
            raise RuntimeError(f"job poller stopped: {exc!r}")
        if self._poll_failures >= MAX_POLL_FAILURES:
            raise RuntimeError(
                f"job poll loop failed {self._poll_failures} rounds in a row "
                f"(limit {MAX_POLL_FAILURES}); last error: {self._last_poll_error}"
            )

    # ---- polling ------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self._kept.flush()
                now = time.monotonic()
                if now - self._last_heartbeat > HEARTBEAT_INTERVAL_S:
                    await self._io(self._store.heartbeat, self._id)
                    self._last_heartbeat = now
                if now - self._last_adopt > ADOPT_INTERVAL_S:
                    await self._adopt()
                if self._runs:
                    await asyncio.gather(*(self._poll_run(j, r) for j, r in list(self._runs.items())))
                self._poll_failures = 0
                if self._state_down_since is not None:
                    log.warning("state database back after %.0fs", time.monotonic() - self._state_down_since)
                    self._state_down_since = None
            except (StateUnavailable, artifacts.StorageUnavailable) as exc:
                # Not this replica's fault, and a restart would not fix it: not a poll failure
                # (the artifact store too: a run's result.json is read through it).
                if self._state_down_since is None:
                    self._state_down_since = time.monotonic()
                    log.error("job poll: %s; retrying every %.1fs (%d write(s) kept)", exc.message,
                              POLL_INTERVAL_S, len(self._kept.pending))
            except Exception as exc:  # noqa: BLE001 - the loop must outlive one bad poll
                self._poll_failures += 1
                self._last_poll_error = f"{type(exc).__name__}: {exc}"[:500]
                log.exception("job poll failed (%d in a row)", self._poll_failures)
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _poll_run(self, job_id: str, run: _Run) -> None:
        record = await self._io(self._store.get_job, job_id, False)
        if record is None or not record.active or record.owner != self._id:
            # Ended elsewhere (cancelled, adopted): stop polling; a run that ended must be gone.
            if record is None or record.status in TERMINAL:
                await self._kill_run(job_id)
            self._runs.pop(job_id, None)
            return
        over = self._over_runtime(record)
        if over:
            await self._kill_run(job_id)
            await self._fail(job_id, over)
            return
        try:
            snap = await asyncio.wait_for(
                _await(run.handle.snapshot.remote(run.log_seq, True, run.history_seq)), SNAPSHOT_TIMEOUT_S)
        except (asyncio.TimeoutError, GetTimeoutError):
            run.missed_polls += 1
            if run.missed_polls >= MAX_MISSED_POLLS:
                await self._fail(job_id, f"the run actor did not answer {MAX_MISSED_POLLS} polls in a row; stopped it")
                await self._kill_run(job_id)
            return
        except RayActorError as exc:
            self._runs.pop(job_id, None)
            await self._run_gone(record, f"the run's actor died ({type(exc).__name__})")
            return
        run.missed_polls = 0
        await self._apply(record, snap, run)
        if snap["status"] in TERMINAL:
            await self._kill_run(job_id)  # its outcome is persisted: release the actor
            return
        if snap["status"] == JobStatus.PENDING:
            await self._check_pending(record, run)

    async def _apply(self, record: JobRecord, snap: dict[str, Any], run: _Run | None) -> None:
        """Persist a run snapshot (only the fields that changed), its newly reported epochs
        and its new log lines."""
        fields: dict[str, Any] = {}
        for key in ("status", "error", "started_at", "finished_at", "progress", "workers",
                    "attempts", "checkpoint", "resumed_from_epoch"):
            if key in snap and snap[key] != getattr(record, key):
                fields[key] = snap[key]
        if "status" in fields and not can_move(record.status, fields["status"]):
            # The table refuses it (e.g. RUNNING back to PENDING); the store would refuse the
            # whole update, so keep the stored status and still persist the rest.
            log.warning("job %s: run reported %s while the job is %s; the status stays", record.id,
                        fields.pop("status"), record.status)
        if snap["status"] != JobStatus.PENDING and record.reason and record.reason.startswith("waiting"):
            fields["reason"] = None
        logs = snap.get("logs") or []
        if logs:
            await self._io(self._store.append_logs, record.id, [tuple(e) for e in logs])
            if run is not None:
                run.log_seq = max(run.log_seq, max(e[0] for e in logs))
        if snap.get("history"):
            await self._io(self._store.put_history, record.id, snap["history"])
            self._epochs.observe(record.id, snap.get("started_at") or record.started_at, snap["history"])
        if run is not None and "history_seq" in snap:
            run.history_seq = max(run.history_seq, int(snap["history_seq"]))
        if fields:
            await self._io(self._store.update_job, record.id, **fields)

    async def _check_pending(self, record: JobRecord, run: _Run) -> None:
        """Refresh a PENDING job's reason; fail it if it can never start or waited too long."""
        now = time.monotonic()
        if now - run.reason_checked_at < PENDING_REASON_INTERVAL_S:
            return
        run.reason_checked_at = now
        spec = JobSpec.model_validate(record.spec)
        bundle = spec.worker_bundle()
        snapshot = await asyncio.to_thread(cluster_snapshot)
        why_not = resources.infeasible_reason(bundle, spec.world_size, snapshot.totals, spec.placement_strategy)
        waiting = resources.pending_reason(bundle, spec.world_size, snapshot, spec.placement_strategy)
        if why_not is None and time.time() - record.created_at > spec.schedule_timeout_s:
            why_not = f"not scheduled within schedule_timeout_s={spec.schedule_timeout_s:g}: still {waiting}"
        if why_not:
            await self._kill_run(record.id)
            await self._fail(record.id, why_not)
        elif waiting != record.reason:
            await self._io(self._store.update_job, record.id, reason=waiting)

    def _over_runtime(self, record: JobRecord) -> str | None:
        """Why an active job must stop for its wall clock, or None."""
        # The job's own limit, never above the service's (which may have been lowered since).
        limit = min(record.spec.get("max_runtime_s") or self._limits.max_runtime_s, self._limits.max_runtime_s)
        took = time.time() - record.created_at
        if took <= limit:
            return None
        return (f"exceeded max_runtime_s={limit:g}: {took:.0f}s since submission, still {record.status} "
                f"(epoch {record.progress.get('epoch', 0)}/{record.progress.get('epochs', '?')})")

    async def _adopt(self) -> None:
        """Take over active jobs whose manager died: re-attach to live runs, else settle them."""
        self._last_adopt = time.monotonic()
        adopted = await self._io(self._store.adopt_orphans, self._id, OWNER_STALE_S)
        for record in adopted:
            try:
                handle = await asyncio.to_thread(ray.get_actor, run_actor_name(record.id), namespace=RUN_NAMESPACE)
            except ValueError:
                await self._run_gone(record, "service restarted")
                continue
            try:
                seq = await self._io(self._store.last_run_log_seq, record.id)
            except StateUnavailable:
                seq = 0  # the job is ours now: poll it; re-stored lines are ignored (same run_seq)
            self._runs[record.id] = _Run(handle, log_seq=seq)
            await self._manager_log(record.id, f"re-attached to the running run by {self._id}")

    async def _run_gone(self, record: JobRecord, why: str) -> None:
        """The run actor is gone: take its outcome from result.json; else start the run
        again (Ray Train resumes it from its last epoch checkpoint), at most MAX_RESUMES
        times; else FAIL the job. Nobody polls the job meanwhile, so this is kept until the
        database and the artifact store answer."""

        async def write() -> None:
            result = await asyncio.to_thread(read_result, self._artifacts, record.id)
            if result is not None:
                await self._apply(record, result, None)  # idempotent: safe to run again
                return
            current = await self._io(self._store.get_job, record.id, False)
            if current is None or not current.active or current.owner != self._id:
                return  # cancelled, deleted or adopted by another manager meanwhile
            if current.resumes >= MAX_RESUMES:
                await self._fail(record.id, f"{why} while the job was {current.status}; its run is gone and was "
                                            f"already resumed {current.resumes} time(s) (limit {MAX_RESUMES})")
                return
            await self._resume(current, why)

        await self._kept.run(f"the outcome of job {record.id}", write)

    async def _resume(self, record: JobRecord, why: str) -> None:
        """Start a new run of an active job whose run died (see the module docstring)."""
        resumes = record.resumes + 1
        if not await self._io(self._store.update_job, record.id, resumes=resumes):
            return  # it ended meanwhile (cancelled): stays so
        await self._manager_log(record.id, f"{why} while the job was {record.status}; {self._id} starts its run "
                                           f"again from the last epoch checkpoint (resume {resumes}/{MAX_RESUMES})")
        dataset_path = None
        spec = JobSpec.model_validate(record.spec)
        if isinstance(spec.dataset, UploadedDataset):
            found = await self._io(self._store.get_dataset, spec.dataset.id)
            if found is None:  # cannot happen while the job is active (delete refuses), but say so
                await self._fail(record.id, f"{why}; cannot resume: its dataset {spec.dataset.id} is gone")
                return
            dataset_path = self._dataset_ref(found[1])
        resume = {"attempts": record.attempts, "started_at": record.started_at, "progress": record.progress,
                  "resumed_from_epoch": record.resumed_from_epoch}
        try:
            await self._launch(record, dataset_path, resume)
        except Exception as exc:  # noqa: BLE001 - recorded
            await self._fail(record.id, f"{why}; could not start its run again: {type(exc).__name__}: {exc}")

    async def _fail(self, job_id: str, error: str) -> None:
        """FAIL an active job (a job that already ended, e.g. CANCELLED, keeps its status).
        Its run is stopped or gone, so the write is kept until it succeeds."""
        finished_at = time.time()
        failed = False  # the update is done; only its log line is left (a retry must not redo it)

        async def write() -> None:
            nonlocal failed
            if not failed:
                failed = await self._io(self._store.update_job, job_id, status=JobStatus.FAILED, error=error,
                                        finished_at=finished_at)
                if not failed:
                    return  # it had ended already (e.g. CANCELLED): nothing to log
            # In this same kept write, so the line keeps its place among the job's lines.
            await self._io(self._store.append_logs, job_id, [(None, finished_at, f"FAILED: {error}")])

        await self._kept.run(f"FAILED of job {job_id}", write)

    async def _kill_run(self, job_id: str) -> None:
        """Stop polling the run and kill its actor (with it, the Ray Train controller and workers)."""
        run = self._runs.pop(job_id, None)
        self._epochs.forget(job_id)
        handle = run.handle if run else None
        if handle is None:
            try:
                handle = await asyncio.to_thread(ray.get_actor, run_actor_name(job_id), namespace=RUN_NAMESPACE)
            except ValueError:
                return
        try:
            await asyncio.to_thread(ray.kill, handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone is fine
            pass

    # ---- helpers ------------------------------------------------------------------------

    async def _record(self, job_id: str, with_history: bool = True) -> JobRecord:
        record = await self._io(self._store.get_job, job_id, with_history)
        if record is None:
            raise NotFound(f"no training job {job_id!r}", code="job_not_found")
        return record

    async def _artifact_key(self, ref: str) -> str:
        """`ref` (a key, or an absolute path inside a local store) as the key of an existing
        artifact: 422 path_outside_state_dir if it lies outside the store, 404 if missing."""
        try:
            key = self._artifacts.key_of(ref)
            self._artifacts.path(key)  # a local store also refuses symlinks out of it
        except ValueError as exc:
            raise InvalidInput(str(exc), code="path_outside_state_dir") from None
        if not await asyncio.to_thread(self._artifacts.exists, key):
            raise NotFound(f"checkpoint {key} does not exist in {self._artifacts.url}", code="checkpoint_not_found")
        return key

    def _dataset_ref(self, recorded: str) -> str:
        """A dataset record's path as the training workers read it: its key (rows from
        before keys hold an absolute path inside the state dir), else the path itself."""
        try:
            return self._artifacts.key_of(recorded)
        except ValueError:
            return recorded

    def _delete_quietly(self, key: str) -> None:
        try:
            self._artifacts.delete(key)
        except (artifacts.StorageUnavailable, OSError) as exc:
            log.warning("could not remove %s from %s: %s", key, self._artifacts.url, exc)

    async def _manager_log(self, job_id: str, line: str) -> None:
        """One of the manager's own log lines for a job; kept and retried if the database is
        unavailable (so a request that already changed a job never fails on its log line)."""
        entry = (None, time.time(), line)

        async def write() -> None:
            await self._io(self._store.append_logs, job_id, [entry])

        await self._kept.run(f"a log line of job {job_id}", write)

    @staticmethod
    async def _io(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking store call off the event loop (SQLite may wait on another writer)."""
        return await asyncio.to_thread(fn, *args, **kwargs)


async def _await(ref: Awaitable[T]) -> T:
    return await ref
