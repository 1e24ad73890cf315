"""The training jobs' owner: commands, datasets, and the poll loop over the run actors.

`Jobs` validates and admits jobs (fail-fast placement check), launches each run as a
detached `TrainRun` actor (service.training.run_actors), polls the runs and is the only
writer of their records, and answers the ingress's job, dataset and checkpoint questions.
It takes its dependencies in its constructor (the job store, the artifact store, the served
weights record, the quotas, the run actors, the clock, the cluster's resources) and starts
with `await open()` (heartbeat, adoption, the poll loop). The JobManager Serve deployment
(service.deployments.job_manager) wires the real ones; the ingress never creates actors, it
only calls that deployment.

Life of a job: PENDING (record written, run actor created, its worker group's placement
group waiting for room; `reason` says what it waits for) -> RUNNING (rank 0 entered the train loop) ->
SUCCEEDED | FAILED | CANCELLED (the allowed moves: service.training.status, which the
store's writes obey). What the poller decides for one job, given its record and what the
cluster says (stop polling, FAIL past a limit, resume a run that died with the service,
settle a PENDING job), is service.training.lifecycle; this class reads the inputs and
carries the decisions out.

Quotas (`TrainingLimits`): admission counts the active jobs, their workers and GPUs in the
same transaction that inserts the job, and dataset uploads count the stored datasets the
same way, so concurrent requests cannot overshoot a limit. `delete_job` and
`delete_dataset` give the space back.

The state database (service.state.db, `GANGSERVE_DATABASE_URL`) may be unreachable: mid-run,
requests that need it answer 503 `state_unavailable`, and the poll loop keeps going. A write
the poller must not lose (a job FAILED after its run was stopped, the outcome of a run that
is gone, a manager log line) is kept in order and retried every round until the database is
back (service.training.kept_writes); progress, history and log lines of live runs are
re-read from the run and written again by the next poll anyway. Restarting the replica
cannot bring a database back, so those failures do not count towards `check_health`.

Files (datasets, run dirs, final checkpoints) live in the artifact store
(service.state.artifacts: the state dir, or object storage); records hold their keys.
`init_from` is resolved and copied at submit (service.training.init_from); which checkpoint
`POST /weights` loads is service.weights.targets.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from typing import Any, Callable, TypeVar

from pydantic import ValidationError

from service.cluster.placement import ClusterSnapshot, cluster_snapshot
from service.config.builder_args import ModelConfig, ServingConfig
from service.contract.errors import Conflict, ErrorCode, InvalidInput, NotFound, describe_validation_errors
from service.metrics.process import process_metrics
from service.metrics.recorders import EpochClock, training_snapshot
from service.state.artifacts import ArtifactStore, StorageUnavailable
from service.state.db import StateUnavailable
from service.training import init_from, lifecycle, resources
from service.training.checkpoints import spec_architecture
from service.training.clock import SYSTEM_CLOCK, Clock
from service.training.kept_writes import KeptWrites
from service.config.builder_args import TrainingLimits
from service.training.limits import ActiveUsage, check_job_alone, check_job_fits
from service.training.epoch_checkpoints import run_prefix
from service.training.run import final_checkpoint_key, read_result
from service.training.run_snapshot import ResumeState, RunSnapshot
from service.training.run_actors import RunActors
from service.training.spec import JobSpec, UploadedDataset
from service.training.status import JobStatus, can_move
from service.training.store import JobRecord, JobStore, iso
from service.training.uploads import Datasets
from service.config.tunables import TrainingTunables
from service.weights import targets
from service.weights.record import WeightsRecord

log = logging.getLogger("gangserve.training")

DEFAULT_MAX_SEQ_LEN: int = ServingConfig.model_fields["max_seq_len"].default
T = TypeVar("T")


@dataclasses.dataclass
class _Run:
    """A run this manager polls: its actor and how far the polls got."""

    handle: Any
    log_seq: int = 0
    history_seq: int = 0
    missed_polls: int = 0
    reason_checked_at: float = 0.0


class Jobs:
    """Owns the job records and the run actors of one app; every wait is bounded."""

    def __init__(self, *, store: JobStore, artifacts: ArtifactStore, weights: WeightsRecord | None,
                 limits: TrainingLimits, runs: RunActors, clock: Clock = SYSTEM_CLOCK,
                 cluster: Callable[[], ClusterSnapshot] = cluster_snapshot, app: str | None = None,
                 app_model: ModelConfig | None = None, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                 tunables: TrainingTunables | None = None) -> None:
        """No I/O here (`open` starts it). `store`: the job records (its database: the state
        database). `artifacts`: datasets, run dirs, checkpoints. `weights`: the app's served
        weights record, read only (init_from a weights version; None: no versions). `limits`:
        the quotas. `runs`: the run actors. `clock`: wall and monotonic time, sleeps.
        `cluster`: the alive nodes' resources (a blocking read, called off the loop). `app`:
        the Serve application's name (its weights record). `app_model`: the app's ModelConfig,
        to regenerate a served version its `init` made and to check that a job POST /weights
        serves has the app's architecture. `max_seq_len`: the serving limit,
        applied to uploaded attention datasets too. `tunables`: the poll loop's timing and
        budgets (the app's training tunables; default, their defaults)."""
        self._store = store
        self._artifacts = artifacts
        self._weights = weights
        self._limits = limits
        self._actors = runs
        self._clock = clock
        self._cluster = cluster
        self._app = app
        self._app_model = app_model
        self._datasets = Datasets(store, artifacts, limits, max_seq_len)
        self._t = tunables or TrainingTunables()
        self._rules = lifecycle.Rules.of(self._t)
        self._id = f"mgr-{uuid.uuid4().hex[:12]}"
        self._runs: dict[str, _Run] = {}
        self._sweeps: set[asyncio.Task[None]] = set()
        self._poller: asyncio.Task[None] | None = None
        self._last_heartbeat = 0.0
        self._last_adopt = 0.0
        self._poll_failures = 0  # consecutive failed rounds of _poll_forever (not the database's)
        self._last_poll_error = ""
        # Writes that found the database unavailable, retried in order (service.training.kept_writes).
        self._kept = KeptWrites()
        self._state_down_since: float | None = None
        self._epochs = EpochClock(process_metrics())  # gangserve_training_epoch_seconds

    @property
    def manager_id(self) -> str:
        """This manager's id: the `owner` of the jobs it polls."""
        return self._id

    async def open(self) -> None:
        """Start: the first heartbeat, adoption of orphaned jobs, then the poll loop in the
        background. StateUnavailable while the database cannot be reached."""
        await self._io(self._store.heartbeat, self._id)
        await self._adopt()
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
        log.info("job manager %s, artifacts in %s", self._id, self._artifacts.url)

    async def close(self) -> None:
        """Stop the poll loop and the late sweeps (the runs and the stores are left as they are)."""
        tasks = [t for t in (self._poller, *self._sweeps) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        log.info("job manager %s stopped polling; its runs go on, for the app's next manager to adopt",
                 self._id)

    # ---- jobs ---------------------------------------------------------------------------

    async def submit(self, spec_doc: dict[str, Any]) -> dict[str, Any]:
        """Admit a job: 422 if invalid or infeasible; else a PENDING record and a run actor."""
        try:
            spec = JobSpec.model_validate(spec_doc)
        except ValidationError as exc:
            raise InvalidInput(f"invalid job spec: {describe_validation_errors(exc.errors())}", code=ErrorCode.INVALID_SPEC) from None
        check_job_alone(self._limits, spec.world_size, spec.use_gpu, spec.max_runtime_s)
        if spec.max_runtime_s is None:  # recorded with the job, so a restart keeps enforcing it
            spec = spec.model_copy(update={"max_runtime_s": self._limits.max_runtime_s})
        dataset_path = await self._datasets.for_job(spec)
        placement = await asyncio.to_thread(self._placement, spec)
        if placement.infeasible:
            raise InvalidInput(placement.infeasible, code=ErrorCode.INFEASIBLE)
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
        now = self._clock.time()
        record = JobRecord(
            id=job_id,
            status=JobStatus.PENDING,
            spec=spec.model_dump(),
            created_at=now,
            updated_at=now,
            progress={"epoch": 0, "epochs": spec.epochs, "step": 0, "loss": None},
            reason=placement.waiting,
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
                                   code=ErrorCode.DATASET_NOT_FOUND) from None
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
                      resume: ResumeState | None = None) -> None:
        """Create the job's run actor and poll it. `resume`: continue a run that died."""
        handle = await self._actors.launch(record.id, record.spec, dataset_path,
                                           init_from.init_key(record.id) if record.init_from else None, resume)
        self._runs[record.id] = _Run(handle)

    async def get_job(self, job_id: str) -> dict[str, Any]:
        return (await self._record(job_id)).to_public()

    async def list_jobs(self, limit: int = 20, cursor: str | None = None) -> dict[str, Any]:
        """Newest first: {"jobs": [...], "next": cursor | None}."""
        if not 1 <= limit <= 200:
            raise InvalidInput(f"limit must be in 1..200, got {limit}", code=ErrorCode.INVALID_REQUEST)
        seq = None
        if cursor is not None:
            if not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 18):
                raise InvalidInput(f"cursor {cursor!r} is not one returned by GET /train", code=ErrorCode.INVALID_REQUEST)
            seq = int(cursor)
        records, nxt = await self._io(self._store.list_jobs, limit, seq)
        return {"jobs": [r.to_public() for r in records], "next": str(nxt) if nxt is not None else None}

    async def cancel(self, job_id: str) -> dict[str, Any]:
        """Stop the run (kill its actor; its workers and their placement group die with it,
        within seconds) and mark it CANCELLED. 409 if it already ended."""
        record = await self._record(job_id, with_history=False)
        if not can_move(record.status, JobStatus.CANCELLED):
            raise Conflict(f"job {job_id} already ended with status {record.status}", code=ErrorCode.JOB_FINISHED)
        changed = await self._io(
            self._store.update_job, job_id, status=JobStatus.CANCELLED, finished_at=self._clock.time(),
            reason="cancelled by request",
        )
        if not changed:  # it ended between the read and the write
            record = await self._record(job_id)
            raise Conflict(f"job {job_id} already ended with status {record.status}", code=ErrorCode.JOB_FINISHED)
        await self._manager_log(job_id, "cancelled by request; stopping the run")
        await self._kill_run(job_id)
        return await self.get_job(job_id)

    async def delete_job(self, job_id: str) -> dict[str, Any]:
        """Remove a job: cancel it if active (its workers are freed within seconds), then its
        record, history, logs, run dir (runs/<job>: epoch checkpoints, result.json) and final
        checkpoint. Served weights are not affected: POST /weights serves its own copy of a
        checkpoint."""
        record = await self._record(job_id, with_history=False)
        if record.active:
            await self._io(
                self._store.update_job, job_id, status=JobStatus.CANCELLED, finished_at=self._clock.time(),
                reason="deleted by request",
            )
            await self._kill_run(job_id)
        if not await self._io(self._store.delete_job, job_id):
            raise NotFound(f"no training job {job_id!r}", code=ErrorCode.JOB_NOT_FOUND)
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
        except StorageUnavailable as exc:
            log.warning("files of deleted job %s not removed: %s", job_id, exc)
            return 0

    async def _late_sweep(self, job_id: str) -> None:
        for delay in self._t.late_sweep_s:
            await self._clock.sleep(delay)
            await asyncio.to_thread(self._remove_job_files, job_id)

    async def logs(self, job_id: str, tail: int = 200) -> dict[str, Any]:
        await self._record(job_id, with_history=False)
        if not 1 <= tail <= 2000:
            raise InvalidInput(f"tail must be in 1..2000, got {tail}", code=ErrorCode.INVALID_REQUEST)
        lines = await self._io(self._store.tail_logs, job_id, tail)
        return {"id": job_id, "lines": [f"{iso(ts)} {line}" for ts, line in lines]}

    async def checkpoint_key(self, job_id: str) -> str:
        """The artifact key of a finished job's final checkpoint (GET /train/{id}/checkpoint
        streams it from the store; POST /weights copies it)."""
        job = self._serving_view(await self._record(job_id, with_history=False), with_model=False)
        return await asyncio.to_thread(targets.job_checkpoint_key, self._artifacts, job)

    async def resolve_weights(self, job_id: str | None = None, checkpoint: str | None = None) -> dict[str, Any]:
        """The dense checkpoint POST /weights should load: {"path" (its artifact key),
        "job_id", "embed_dim", "num_heads"} (service.weights.targets). A job's model must be
        the app's architecture (409 checkpoint_mismatch naming both); a client-given path
        must be a key inside the artifact store."""
        if (job_id is None) == (checkpoint is None):
            raise InvalidInput("give exactly one of job_id or checkpoint", code=ErrorCode.INVALID_REQUEST)
        if job_id is not None:
            job = self._serving_view(await self._record(job_id, with_history=False))
            served = targets.served_architecture(self._app_model) if self._app_model is not None else None
            return await asyncio.to_thread(targets.job_target, self._artifacts, job, served)
        assert checkpoint is not None
        return await asyncio.to_thread(targets.checkpoint_target, self._artifacts, checkpoint)

    @staticmethod
    def _serving_view(record: JobRecord, with_model: bool = True) -> targets.JobCheckpoint:
        """What serving needs of a job's record (service.weights.targets imports no training
        code); `with_model`: also the model it trained (read from its spec)."""
        checkpoint = record.checkpoint["path"] if record.status == JobStatus.SUCCEEDED and record.checkpoint else None
        job = targets.JobCheckpoint(job_id=record.id, status=record.status, error=record.error, checkpoint=checkpoint)
        if not with_model:
            return job
        return dataclasses.replace(job, architecture=spec_architecture(JobSpec.model_validate(record.spec).model))

    # ---- datasets (service.training.uploads) --------------------------------------------

    async def upload_dataset(self, body: bytes) -> dict[str, Any]:
        return await self._datasets.upload(body)

    async def delete_dataset(self, dataset_id: str) -> dict[str, Any]:
        return await self._datasets.delete(dataset_id)

    async def list_datasets(self) -> dict[str, Any]:
        return await self._datasets.list()

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
        """Fails when the poll loop is not running or has failed `max_poll_failures` rounds in
        a row (jobs would then go unwatched: no progress, no runtime limit, no failure detection)."""
        if self._poller is None:
            raise RuntimeError("job poller not started: Jobs.open was not awaited")
        if self._poller.done():
            exc = self._poller.exception() if not self._poller.cancelled() else None
            raise RuntimeError(f"job poller stopped: {exc!r}")
        if self._poll_failures >= self._t.max_poll_failures:
            raise RuntimeError(
                f"job poll loop failed {self._poll_failures} rounds in a row "
                f"(limit {self._t.max_poll_failures}); last error: {self._last_poll_error}"
            )

    # ---- polling ------------------------------------------------------------------------

    async def poll_round(self) -> None:
        """One round of the poll loop: the kept writes, the heartbeat and adoption when they
        are due, then one poll of every run this manager polls. Raises what a round hit
        (StateUnavailable / StorageUnavailable while the stores are away)."""
        await self._kept.flush()
        now = self._clock.monotonic()
        if now - self._last_heartbeat > self._t.heartbeat_interval_s:
            await self._io(self._store.heartbeat, self._id)
            self._last_heartbeat = now
        if now - self._last_adopt > self._t.adopt_interval_s:
            await self._adopt()
        if self._runs:
            await asyncio.gather(*(self._poll_run(j, r) for j, r in list(self._runs.items())))

    async def _poll_forever(self) -> None:
        """`poll_round` every `poll_interval_s`; counts the rounds that failed for this
        replica's own reasons (`check_health`), not those of a database or store that is away."""
        while True:
            try:
                await self.poll_round()
                self._poll_failures = 0
                if self._state_down_since is not None:
                    log.warning("state database back after %.0fs", self._clock.monotonic() - self._state_down_since)
                    self._state_down_since = None
            except (StateUnavailable, StorageUnavailable) as exc:
                # Not this replica's fault, and a restart would not fix it: not a poll failure
                # (the artifact store too: a run's result.json is read through it).
                if self._state_down_since is None:
                    self._state_down_since = self._clock.monotonic()
                    log.error("job poll: %s; retrying every %.1fs (%d write(s) kept)", exc.message,
                              self._t.poll_interval_s, len(self._kept.pending))
            except Exception as exc:  # noqa: BLE001 - the loop must outlive one bad poll
                self._poll_failures += 1
                self._last_poll_error = f"{type(exc).__name__}: {exc}"[:500]
                log.exception("job poll failed (%d in a row)", self._poll_failures)
            await self._clock.sleep(self._t.poll_interval_s)

    async def _poll_run(self, job_id: str, run: _Run) -> None:
        """One poll of one run, carried out as service.training.lifecycle decides."""
        record = await self._io(self._store.get_job, job_id, False)
        before = lifecycle.before_poll(record, self._id, self._limits.max_runtime_s, self._clock.time())
        if isinstance(before, lifecycle.Untrack):
            if before.kill:
                await self._kill_run(job_id)
            self._runs.pop(job_id, None)
            return
        if isinstance(before, lifecycle.Fail):
            await self._stop(job_id, before.error)
            return
        assert record is not None  # before_poll untracks a deleted job
        seen = await self._actors.poll(run.handle, run.log_seq, run.history_seq, self._t.snapshot_timeout_s)
        decision = lifecycle.after_poll(seen, run.missed_polls, self._rules)
        if isinstance(decision, lifecycle.Missed):
            run.missed_polls = decision.count
        elif isinstance(decision, lifecycle.Fail):
            await self._stop(job_id, decision.error)
        elif isinstance(decision, lifecycle.RunGone):
            self._runs.pop(job_id, None)
            await self._run_gone(record, decision.why)
        else:
            assert isinstance(seen, lifecycle.Answered)
            run.missed_polls = 0
            await self._apply(record, seen.snapshot, run)
            if decision.release:
                await self._kill_run(job_id)  # its outcome is persisted: release the actor
            elif decision.check_pending:
                await self._check_pending(record, run)

    async def _apply(self, record: JobRecord, snap: RunSnapshot, run: _Run | None) -> None:
        """Persist a run snapshot (only the fields that changed: lifecycle.snapshot_changes),
        its newly reported epochs and its new log lines."""
        changes = lifecycle.snapshot_changes(record, snap)
        if changes.refused is not None:
            log.warning("job %s: run reported %s while the job is %s; the status stays", record.id,
                        changes.refused, record.status)
        if snap.logs:
            await self._io(self._store.append_logs, record.id, [(e.seq, e.at, e.line) for e in snap.logs])
            if run is not None:
                run.log_seq = max(run.log_seq, max(e.seq for e in snap.logs))
        if snap.history:
            await self._io(self._store.put_history, record.id, snap.history_rows())
            self._epochs.observe(record.id, snap.started_at or record.started_at,
                                 [(h.epoch, h.at) for h in snap.history])
        if run is not None:
            run.history_seq = max(run.history_seq, snap.history_seq)
        if changes.fields:
            await self._io(self._store.update_job, record.id, **changes.fields)

    def _placement(self, spec: JobSpec) -> lifecycle.Placement:
        """What the cluster says about the job's workers now (blocking: one GCS read)."""
        bundle = spec.worker_bundle()
        snapshot = self._cluster()
        return lifecycle.Placement(
            infeasible=resources.infeasible_reason(bundle, spec.world_size, snapshot.totals, spec.placement_strategy),
            waiting=resources.pending_reason(bundle, spec.world_size, snapshot, spec.placement_strategy))

    async def _check_pending(self, record: JobRecord, run: _Run) -> None:
        """Refresh a PENDING job's reason, or stop it (lifecycle.pending_check), at most every
        `pending_reason_interval_s`."""
        now = self._clock.monotonic()
        if now - run.reason_checked_at < self._t.pending_reason_interval_s:
            return
        run.reason_checked_at = now
        spec = JobSpec.model_validate(record.spec)
        placement = await asyncio.to_thread(self._placement, spec)
        decision = lifecycle.pending_check(record, spec, placement, self._clock.time())
        if isinstance(decision, lifecycle.Fail):
            await self._stop(record.id, decision.error)
        elif isinstance(decision, lifecycle.SetReason):
            await self._io(self._store.update_job, record.id, reason=decision.reason)

    async def _adopt(self) -> None:
        """Take over active jobs whose manager died: re-attach to live runs, else settle them."""
        self._last_adopt = self._clock.monotonic()
        adopted = await self._io(self._store.adopt_orphans, self._id, self._t.owner_stale_s)
        for record in adopted:
            handle = await self._actors.find(record.id)
            decision = lifecycle.adoption(handle is not None)
            if isinstance(decision, lifecycle.RunGone):
                await self._run_gone(record, decision.why)
                continue
            try:
                seq = await self._io(self._store.last_run_log_seq, record.id)
            except StateUnavailable:
                seq = 0  # the job is ours now: poll it; re-stored lines are ignored (same run_seq)
            self._runs[record.id] = _Run(handle, log_seq=seq)
            await self._manager_log(record.id, f"re-attached to the running run by {self._id}")

    async def _run_gone(self, record: JobRecord, why: str) -> None:
        """The run actor is gone: take its outcome from result.json; else settle it
        (lifecycle.settle_gone_run: resume, FAIL, or leave a job that ended or moved). Nobody
        polls the job meanwhile, so this is kept until the database and the artifact store answer."""

        async def write() -> None:
            result = await asyncio.to_thread(read_result, self._artifacts, record.id)
            if result is not None:
                await self._apply(record, result, None)  # idempotent: safe to run again
                return
            current = await self._io(self._store.get_job, record.id, False)
            decision = lifecycle.settle_gone_run(current, self._id, why, self._rules)
            if isinstance(decision, lifecycle.Fail):
                await self._fail(record.id, decision.error)
            elif isinstance(decision, lifecycle.Resume):
                assert current is not None
                await self._resume(current, why, decision.resumes)

        await self._kept.run(f"the outcome of job {record.id}", write)

    async def _resume(self, record: JobRecord, why: str, resumes: int) -> None:
        """Start a new run of an active job whose run died, as its `resumes`-th resume; Ray
        Train resumes it from the run dir's last registered epoch checkpoint."""
        if not await self._io(self._store.update_job, record.id, resumes=resumes):
            return  # it ended meanwhile (cancelled): stays so
        await self._manager_log(record.id, f"{why} while the job was {record.status}; {self._id} starts its run "
                                           f"again from the last epoch checkpoint (resume {resumes}/"
                                           f"{self._rules.max_resumes})")
        dataset_path = None
        spec = JobSpec.model_validate(record.spec)
        if isinstance(spec.dataset, UploadedDataset):
            dataset_path = await self._datasets.path_of(spec.dataset.id)
            if dataset_path is None:  # cannot happen while the job is active (delete refuses), but say so
                await self._fail(record.id, f"{why}; cannot resume: its dataset {spec.dataset.id} is gone")
                return
        try:
            await self._launch(record, dataset_path, lifecycle.resume_state(record))
        except Exception as exc:  # noqa: BLE001 - recorded
            await self._fail(record.id, f"{why}; could not start its run again: {type(exc).__name__}: {exc}")

    async def _stop(self, job_id: str, error: str) -> None:
        """Kill the job's run, then FAIL it with `error`."""
        await self._kill_run(job_id)
        await self._fail(job_id, error)

    async def _fail(self, job_id: str, error: str) -> None:
        """FAIL an active job (a job that already ended, e.g. CANCELLED, keeps its status).
        Its run is stopped or gone, so the write is kept until it succeeds."""
        finished_at = self._clock.time()
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
        """Stop polling the run and kill its actor (with it, its workers and their placement group)."""
        run = self._runs.pop(job_id, None)
        self._epochs.forget(job_id)
        handle = run.handle if run else await self._actors.find(job_id)
        if handle is not None:
            await self._actors.kill(handle)

    # ---- helpers ------------------------------------------------------------------------

    async def _record(self, job_id: str, with_history: bool = True) -> JobRecord:
        record = await self._io(self._store.get_job, job_id, with_history)
        if record is None:
            raise NotFound(f"no training job {job_id!r}", code=ErrorCode.JOB_NOT_FOUND)
        return record

    async def _manager_log(self, job_id: str, line: str) -> None:
        """One of the manager's own log lines for a job; kept and retried if the database is
        unavailable (so a request that already changed a job never fails on its log line)."""
        entry = (None, self._clock.time(), line)

        async def write() -> None:
            await self._io(self._store.append_logs, job_id, [entry])

        await self._kept.run(f"a log line of job {job_id}", write)

    @staticmethod
    async def _io(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking store call off the event loop (SQLite may wait on another writer)."""
        return await asyncio.to_thread(fn, *args, **kwargs)

