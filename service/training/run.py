"""TrainRun: one job's run, a detached named Ray actor that runs its worker groups.

Why an actor per run: training blocks until it ends, so it runs on this actor's background
thread and nothing in the HTTP path waits on it. Each attempt is one worker group
(service.training.worker_group): placed, trained, shut down. An attempt that fails (a rank
raised, died, or its node was lost) is followed by a new group that resumes from the run's
newest registered checkpoint, up to the job's `max_failures` times; then the run FAILS with
the last attempt's error. Cancel = `ray.kill` of this actor: the workers and the placement
group it created die with it.

Why detached and named: a JobManager replica that restarts re-attaches to runs still in
flight (`ray.get_actor(name, namespace)`) instead of losing them. The outcome is also
written to `result.json` in the run dir, so a manager that comes back after the actor has
gone still learns how the run ended.

Where the files go: the artifact store (service.state.artifacts): the epoch checkpoints
and their pointer under `runs/<job>` (service.training.epoch_checkpoints), the final dense
checkpoint as `checkpoints/<job>.safetensors` and the outcome as `runs/<job>/result.json`.
No node needs a shared directory when the store is object storage.

The actor keeps the live state (status, progress, history, workers, log lines); the
JobManager polls `snapshot()` and is the only writer of the SQLite records.

Resuming after the service restarted: a run whose actor died (head restart, the actor's
node lost) is started again by the JobManager as a new TrainRun of the same job, given the
record's `resume` state (attempts so far, started_at, progress). Its first worker group
starts from the run's newest registered checkpoint, as a group replacing a failed one does,
so training continues from there, and the epochs it reports again replace the recorded ones
(one history entry per epoch). A snapshot carries only what is new since the manager's last
one: log lines after `since_log_seq`, history entries reported after `since_history_seq`.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import ray

from service.state import artifacts

from service.training.epoch_checkpoints import latest, run_prefix
from service.training.run_snapshot import (
    EpochEntry, FinalCheckpoint, LogLine, Progress, ResumeState, RunSnapshot, WorkerEntry,
)
from service.training.spec import JobSpec
from service.training.status import JobStatus, check_transition
from service.training.worker_group import AttemptFailed, WorkerGroup, short_error
from service.training.worker_reports import EpochReport, WorkerLoop
from service.config.tunables import Tunables

RUN_NAMESPACE = "gangserve"
log = logging.getLogger("gangserve.training")
RESULT_FILE = "result.json"


def run_actor_name(job_id: str) -> str:
    return f"gangserve-train-{job_id}"


def final_checkpoint_key(job_id: str) -> str:
    return f"checkpoints/{job_id}.safetensors"


def read_result(store: artifacts.ArtifactStore, job_id: str) -> RunSnapshot | None:
    """The outcome a run wrote when it ended, or None: none written, or not a snapshot (a run
    killed mid-write; logged) (StorageUnavailable if the store is down)."""
    try:
        data = store.read_bytes(f"{run_prefix(job_id)}/{RESULT_FILE}")
    except FileNotFoundError:
        return None
    try:
        return RunSnapshot.from_json(data)
    except ValueError as exc:
        log.warning("job %s: its %s is unreadable (%s); treated as absent", job_id, RESULT_FILE, exc)
        return None


class TrainRun:
    """Live state of one run; its worker groups run on a daemon thread started in __init__."""

    def __init__(self, job_id: str, spec: dict[str, Any], dataset_key: str | None,
                 init_key: str | None = None, resume: ResumeState | None = None,
                 tunables: Tunables | None = None) -> None:
        """`dataset_key`: the uploaded dataset's artifact key (or a legacy absolute path).
        `init_key`: the job's copy of its init_from weights (loaded on a fresh start only).
        `resume`: the job record's state when this run continues one that died with the
        service (None: the job's first run).
        `tunables`: the app's (its training section bounds this actor's logs and linger; the
        whole travels to the workers); default, the defaults."""
        self._tunables = tunables or Tunables()
        self._job_id = job_id
        self._spec = JobSpec.model_validate(spec)
        self._store = artifacts.store(self._tunables.state)  # from this actor's environment (inherited from the JobManager)
        self._dataset_path = dataset_key
        self._lock = threading.Lock()
        self._status = JobStatus.PENDING
        self._error: str | None = None
        self._started_at: float | None = None
        self._finished_at: float | None = None
        self._epoch = 0
        self._step = 0
        self._current_loss: float | None = None
        # Each history entry with its report number (never sent): snapshots carry the suffix
        # of the history reported after the caller's since_history_seq.
        self._history: list[tuple[int, EpochEntry]] = []
        self._history_seq = 0
        self._workers: dict[int, WorkerEntry] = {}
        self._attempts = 0
        self._new_attempt = True  # the next worker to start opens an attempt (set for each group)
        self._resumed_from_epoch: int | None = None
        self._init_key = init_key
        if resume:
            # Continue the record: attempts count on, and the job stays RUNNING (with its
            # progress) while the new worker group comes up, if it had started before.
            self._attempts = resume.attempts
            self._started_at = resume.started_at
            if self._started_at is not None:
                self._status = JobStatus.RUNNING
            self._epoch, self._step = resume.progress.epoch, resume.progress.step
            self._current_loss = resume.progress.loss
            self._resumed_from_epoch = resume.resumed_from_epoch
        self._checkpoint: FinalCheckpoint | None = None
        self._logs: collections.deque[tuple[int, float, str]] = collections.deque(maxlen=self._tunables.training.max_run_log_lines)
        self._log_seq = 0
        self._last_poll = time.monotonic()
        self._log(
            f"run actor pid {os.getpid()}: {self._spec.world_size} worker(s) x {self._spec.worker_bundle()}, "
            f"{self._spec.epochs} epoch(s), model {self._spec.model.kind}, max_failures {self._spec.max_failures}"
            + (f"; resuming the job after its run died (attempts so far: {self._attempts})" if resume else "")
        )
        self._handle = ray.get_runtime_context().current_actor
        threading.Thread(target=self._run, name=f"fit-{job_id}", daemon=True).start()
        threading.Thread(target=self._linger_watchdog, name="linger", daemon=True).start()

    # ---- the run ------------------------------------------------------------------------

    def _run(self) -> None:
        spec = self._spec
        loop = WorkerLoop(job_id=self._job_id, spec=spec, reporter=self._handle, dataset_path=self._dataset_path,
                          init_key=self._init_key, tunables=self._tunables)
        try:
            self._attempts_until_done(loop)
            done = latest(self._store, self._job_id)
            if done is None or done.epoch != spec.epochs:
                raise RuntimeError(f"training finished without the final checkpoint (epoch {spec.epochs}); the run's "
                                   f"newest is {'none' if done is None else f'epoch {done.epoch}'}")
            final = final_checkpoint_key(self._job_id)
            # Atomic (temp + rename locally, one PUT on S3): a reader never sees half of it.
            nbytes = self._store.write_bytes(final, self._store.read_bytes(done.model_key))
            checkpoint = FinalCheckpoint(
                path=final, url=f"/train/{self._job_id}/checkpoint",
                format=f"dense-{spec.model.kind}" if spec.model.kind != "linear" else "linear", bytes=nbytes)
            with self._lock:
                self._checkpoint = checkpoint
            self._finish(JobStatus.SUCCEEDED, None)
        except BaseException as exc:  # noqa: BLE001 - every outcome must be recorded
            self._log("training failed:\n" + "".join(traceback.format_exception(exc)).strip())
            with self._lock:
                attempts = max(self._attempts, 1)
            self._finish(
                JobStatus.FAILED,
                f"training failed after {attempts} attempt(s) (max_failures={spec.max_failures}): "
                + (str(exc) if isinstance(exc, AttemptFailed) else short_error(exc)),
            )

    def _attempts_until_done(self, loop: WorkerLoop) -> None:
        """Worker groups, one per attempt, until one trains to the end; the last failure
        raised once `max_failures` groups failed before it."""
        failures = 0
        while True:
            group = WorkerGroup(self._spec, self._tunables.training.group_timeout_s, self._log)
            with self._lock:
                self._new_attempt = True  # the group's first worker to start opens the attempt
            self._log(f"starting a worker group of {self._spec.world_size} rank(s)")
            try:
                group.run(loop)
                return
            except AttemptFailed as exc:
                failures += 1
                if failures > self._spec.max_failures:
                    raise
                self._log(f"the worker group failed ({exc}); starting a new one from the newest checkpoint "
                          f"(failure {failures} of at most {self._spec.max_failures})")
            finally:
                group.shutdown()

    def _finish(self, status: JobStatus, error: str | None) -> None:
        """Record the outcome: result.json first, then the live status the manager polls
        (the manager kills this actor once it sees a terminal status, so the file must
        already be complete by then). The move is checked against the one transition table
        (service.training.status): a run ends once."""
        with self._lock:
            status = check_transition(self._status, status, self._job_id)
        finished_at = time.time()
        took = finished_at - (self._started_at or finished_at)
        self._log(f"run {status}" + (f": {error}" if error else "") + f" ({took:.1f}s after the first worker started)")
        outcome = dataclasses.replace(self.snapshot(0, touch=False), status=status, error=error,
                                      finished_at=finished_at)
        try:
            self._store.write_bytes(f"{run_prefix(self._job_id)}/{RESULT_FILE}", outcome.to_json())
        except Exception as exc:  # noqa: BLE001 - the live status below still reaches the manager
            self._log(f"could not write {RESULT_FILE}: {type(exc).__name__}: {exc}")
        with self._lock:
            self._status, self._error, self._finished_at = status, error, finished_at

    def _linger_watchdog(self) -> None:
        while True:
            time.sleep(10)
            with self._lock:
                done = self._finished_at is not None
                idle = time.monotonic() - self._last_poll
            if done and idle > self._tunables.training.finished_linger_s:
                os._exit(0)  # nobody collects us; result.json holds the outcome

    # ---- called by the train workers (fire-and-forget) ----------------------------------

    def worker_started(self, rank: int, world_size: int, pid: int, node_id: str, resumed_epoch: int | None,
                       node_ip: str | None = None, iface: str | None = None) -> None:
        with self._lock:
            # An attempt counts once its group's first worker started.
            if self._new_attempt:
                self._attempts += 1
                self._new_attempt = False
            if rank == 0 and resumed_epoch is not None:
                self._resumed_from_epoch = int(resumed_epoch)
            if self._status == JobStatus.PENDING:
                self._status, self._started_at = JobStatus.RUNNING, time.time()
            self._workers[rank] = WorkerEntry(rank=rank, pid=pid, node_id=node_id, node_ip=node_ip, iface=iface,
                                              attempt=self._attempts)
            attempt = self._attempts
        where = (f"resuming from the checkpoint after epoch {resumed_epoch}" if resumed_epoch is not None
                 else "from the init_from weights" if self._init_key else "from scratch")
        self._log(f"attempt {attempt}: rank {rank}/{world_size} started (pid {pid}, node {node_id[:12]}), {where}")

    def worker_output(self, rank: int, lines: list[tuple[str, str]]) -> None:
        """A worker's captured stdout/stderr lines (service.training.worker_output), oldest
        first, as (stream, line): logged as "[rank R] line" (stderr: "[rank R stderr] line")."""
        # At most max_output_lines_per_call lines (more than a worker's ring holds), each cut
        # as the worker cuts it (one value).
        t = self._tunables.training
        tagged = []
        for stream, line in list(lines)[-t.max_output_lines_per_call:]:
            tag = f"[rank {int(rank)}]" if stream in ("stdout", "note") else f"[rank {int(rank)} {str(stream)[:10]}]"
            tagged.append(f"{tag} {str(line)[:t.output_line_chars]}")
        self._log(*tagged)

    def step(self, epoch: int, step: int, loss: float) -> None:
        with self._lock:
            self._step = step
            self._current_loss = loss

    def history_restored(self, entries: list[EpochEntry], step: int) -> None:
        """A resumed worker group's checkpoint: the job's epochs 1..c it stands on (c its epoch)
        and the step count there. They replace the history, reported anew, so the manager's
        "epoch e replaces e and what follows" rebuilds the record's history as 1..c, epochs a
        run that died never recorded included; the attempt goes on from c + 1."""
        if not entries:
            return
        with self._lock:
            self._history = []
            for entry in entries:
                self._history_seq += 1
                self._history.append((self._history_seq, entry))
            last = entries[-1]
            self._epoch, self._step, self._current_loss = last.epoch, step, last.loss
        self._log(f"history of epochs 1..{last.epoch} restored from the checkpoint")

    def epoch_done(self, report: EpochReport) -> None:
        with self._lock:
            # A resumed attempt re-reports epochs after its checkpoint: keep one entry per epoch.
            self._history = [(seq, h) for seq, h in self._history if h.epoch < report.epoch]
            self._history_seq += 1
            self._history.append((self._history_seq, report.entry()))
            self._epoch, self._step, self._current_loss = report.epoch, report.step, report.loss
        self._log(f"epoch {report.epoch}/{self._spec.epochs}: loss {report.loss:.6g}"
                  + (f", eval_loss {report.eval_loss:.6g}" if report.eval_loss is not None else "")
                  + f", step {report.step}, {report.epoch_s:.2f}s"
                  + (f" (+{report.checkpoint_s * 1000:.0f} ms writing its checkpoint, "
                     f"+{(report.checkpoint_wait_s or 0) * 1000:.0f} ms waiting for the previous upload)"
                     if report.checkpoint_s is not None
                     else f" (no checkpoint: {report.no_checkpoint})"))

    # ---- called by the JobManager -------------------------------------------------------

    def snapshot(self, since_log_seq: int, touch: bool = True, since_history_seq: int = 0) -> RunSnapshot:
        """Everything the manager persists; log lines with seq > since_log_seq and the
        history entries reported after since_history_seq (always a suffix of the history,
        in epoch order: storing each one as "this epoch, and nothing after it" rebuilds
        the run's history exactly). `history_seq` is the value to pass next time."""
        with self._lock:
            if touch:
                self._last_poll = time.monotonic()
            return RunSnapshot(
                status=self._status, error=self._error, started_at=self._started_at, finished_at=self._finished_at,
                progress=Progress(epoch=self._epoch, epochs=self._spec.epochs, step=self._step,
                                  loss=self._current_loss),
                history=tuple(h for seq, h in self._history if seq > since_history_seq),
                history_seq=self._history_seq,
                workers=tuple(self._workers[r] for r in sorted(self._workers)),
                attempts=self._attempts, resumed_from_epoch=self._resumed_from_epoch, checkpoint=self._checkpoint,
                logs=tuple(LogLine(seq, at, line) for seq, at, line in self._logs if seq > since_log_seq),
            )

    def _log(self, *lines: str) -> None:
        with self._lock:
            now = time.time()
            for line in lines:
                self._log_seq += 1
                self._logs.append((self._log_seq, now, line))
