"""The per-worker train loop that Ray Train's TorchTrainer runs on every DDP rank.

    prepare_model      -> DistributedDataParallel (gloo on CPU, NCCL on GPUs)
    prepare_data_loader-> DistributedSampler (set_epoch every epoch, so shuffles differ)
    ray.train.report   -> the epochs that carry a checkpoint, on every rank (it is a barrier);
                          rank 0 attaches the checkpoint: model.safetensors (the dense
                          serving format for attention) + train_state.pt (epoch, step,
                          optimizer state, and the job's history up to that epoch). See
                          "Reports" below.
    ray.train.get_checkpoint -> after a worker failure, Ray Train restarts the worker group
                          and the loop resumes from the last reported checkpoint.

Loss: the squared L2 error of each target vector, averaged over vectors (for a
Linear(10, 1) this is exactly the notes' nn.MSELoss; for attention it is E times it, which
keeps plain SGD at lr 0.01 visibly learning). The epoch loss reported is the mean over every
sample of every rank (all-reduced), so it is the same on all ranks.

Progress goes to the job's run actor (`reporter`): every rank announces itself (pid, node)
and rank 0 reports each finished epoch, both acknowledged within training.ack_timeout_s; step
progress is fire-and-forget, at most every training.progress_interval_s.

The worker's own stdout/stderr (each rank prints one line per epoch; anything else the loop,
torch or Ray print in this process too) is captured by `worker_output.OutputCapture` and
sent to the run actor after every epoch, at most every training.output_interval_s within one, and
when the loop ends: the job's logs show it tagged by rank ("[rank 1] ...").

A checkpoint carries the history: every epoch's entry up to its own (this attempt's and those
it resumed from). A resumed worker group's rank 0 hands them to the run actor
(`history_restored`) before its first step, so the job's history holds every epoch the
checkpoint stands on even when the run that finished one died before recording it (a killed
run's workers can finish an epoch and register its checkpoint after their run actor is gone).

Initial weights: a fresh start (no Ray Train checkpoint) loads `init_key` (the job's copy of
its `init_from` weights, an artifact key) when given, else the seeded random init.

Validation: after each epoch's steps every rank evaluates its share (rank r: samples r, r +
world, ...) of the held-out samples with the bare module, no gradients; the sums are
all-reduced, so `eval_loss` is the exact mean over all held-out vectors (same loss as
training). None when the job holds out nothing.

Checkpoints off the step path: rank 0 writes the epoch's files to a local temp dir (a
memory-speed write of the model and optimizer state) and reports them with
`CheckpointUploadMode.ASYNC`: Ray Train's single upload thread copies them to storage while
the next epoch trains, then deletes the temp dir. At most one upload is in flight: an epoch
that ends while the previous upload still runs reports no checkpoint (the steps never wait
for storage), nor one within REPORT_INTERVAL_S of the previous (see "Reports"), except the
last epoch, which waits for the upload (at most training.checkpoint_wait_s) and writes the
final one. Bound on lost work: a crash loses the epochs since the newest uploaded
checkpoint, at most ceil(max(upload time, REPORT_INTERVAL_S) / epoch time) + 1 epochs. Each epoch's
metrics carry rank 0's time on the step path: `checkpoint_s` writing the local files and
`checkpoint_wait_s` waiting for the previous upload (non-zero only at the last epoch),
both None for an epoch without a checkpoint (`no_checkpoint` says why).

Reports: Ray Train's controller takes one report per worker each time it looks at its workers
(every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default), and a run ends only once every
report was taken. A report per epoch kept a run of short epochs alive for about epochs x
interval after its last step (a 16-epoch job of 0.1 s epochs: 7 s at a 0.5 s interval, ~30 s
at the default), and each report is a barrier through Ray Train's synchronization actor. So
the ranks report to Ray Train only the epochs that carry a checkpoint, and rank 0 writes one
at most once per interval (`REPORT_INTERVAL_S`; always the first epoch of an attempt and the
last epoch): at most one report is queued at the end. The epochs' progress reaches the run
actor as before (`epoch_done`, every epoch). Every rank must call report alike, so rank 0's
decision travels in the epoch's loss all-reduce (a third element, only rank 0's non-zero).
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train import CheckpointUploadMode
import torch
import torch.distributed as dist
from ray.train.torch import get_device, prepare_data_loader, prepare_model
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from safetensors.torch import load as st_load_torch

from service.cluster.scratch import sweep_dead_owners
from service.state import artifacts
from service.training.checkpoints import MODEL_FILE
from service.training.datasets import Samples, load_uploaded, split, synthetic
from service.training.models import build_model, load_model, load_tensors, save_model
from service.training.run_snapshot import EpochEntry
from service.training.spec import JobSpec, ModelSpecT, SyntheticDataset
from service.training.worker_output import OutputCapture
from service.training.worker_reports import EpochReport, WorkerLoop

# How often Ray Train's controller takes a report (see "Reports" in the module docstring): its
# own environment variable and default, which Ray Train hands to its workers.
REPORT_INTERVAL_S = float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0"))

TRAIN_STATE_FILE = "train_state.pt"


def vector_sq_error(out: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over vectors of ||out - target||^2 (sum over the last axis); with `mask`
    ([batch, seq] bool, True = token) the mean is over token vectors only: padded
    positions add nothing to the loss or its gradient."""
    err = (out - target).pow(2).sum(dim=-1)  # [batch] or [batch, seq]
    if mask is None:
        return err.mean()
    return err[mask].mean()


def _batch(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x, y, mask or None) of a loader batch ((x, y) or (x, y, mask))."""
    return (batch[0], batch[1], batch[2]) if len(batch) == 3 else (batch[0], batch[1], None)


def send_output(reporter: Any, rank: int, capture: OutputCapture, ack_timeout_s: float, final: bool = False) -> None:
    """Send the captured lines to the run actor, acknowledged (so they arrive in order, and
    the last ones before fit() returns, each within `ack_timeout_s`); never fails the
    training for its logs."""
    lines = capture.drain(final)
    if not lines:
        return
    try:
        ray.get(reporter.worker_output.remote(rank, lines), timeout=ack_timeout_s)
    except Exception as exc:  # noqa: BLE001
        print(f"could not send {len(lines)} output line(s) to the run actor: {type(exc).__name__}", file=sys.stderr)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """One worker's training: `config` is the run actor's train_loop_config, which holds a
    `WorkerLoop` (service.training.worker_reports)."""
    loop = WorkerLoop.of(config)
    rank = ray.train.get_context().get_world_rank()
    capture = OutputCapture(loop.tunables.training)
    with capture.installed():
        try:
            _train(loop, capture)
        finally:
            send_output(loop.reporter, rank, capture, loop.tunables.training.output_ack_timeout_s, final=True)


@dataclass(frozen=True)
class _Start:
    """Where a worker's training starts: epoch and step counts, and the optimizer's state."""

    epoch: int
    step: int
    optimizer_state: dict[str, Any] | None
    resumed: bool  # from Ray Train's checkpoint (a restarted worker group, or a run resumed after a restart)
    history: tuple[EpochEntry, ...] = ()  # the checkpoint's epochs 1..epoch (none in one written before it kept them)


def _start(model: nn.Module, loop: WorkerLoop) -> _Start:
    """Loads `model`'s weights where the run starts from: Ray Train's latest checkpoint (set after
    a worker-group restart, and when a run of the same name resumes after the service
    restarted), else the job's init_from weights, else the seeded init `model` already holds."""
    spec = loop.spec
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            load_model(model, spec.model, Path(d) / MODEL_FILE)
            return read_train_state(Path(d) / TRAIN_STATE_FILE)
    if loop.init_key:
        # Fine-tuning: the job's own copy of its init_from weights (shapes checked at submit).
        store = artifacts.store(loop.tunables.state)
        load_tensors(model, spec.model, st_load_torch(store.read_bytes(loop.init_key)))
    return _Start(0, 0, None, resumed=False)


def read_train_state(path: Path) -> _Start:
    """Where a checkpoint's train_state.pt (CheckpointWriter.write) resumes the run."""
    # map_location: the optimizer state was saved from whichever cuda:N that worker had;
    # load it on the CPU (load_state_dict moves it to the parameters' device).
    state = torch.load(path, map_location="cpu", weights_only=True)
    history = tuple(EpochEntry(**entry) for entry in state.get("history", ()))
    return _Start(int(state["epoch"]), int(state["step"]), state["optimizer"], resumed=True, history=history)


def _optimizer(model: nn.Module, spec: JobSpec, state: dict[str, Any] | None) -> torch.optim.Optimizer:
    """The job's optimizer over `model`'s parameters, with its restored state when resuming."""
    optimizer: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=spec.lr) if spec.optimizer == "sgd"
        else torch.optim.Adam(model.parameters(), lr=spec.lr)
    )
    if state is not None:
        optimizer.load_state_dict(state)
    return optimizer


class _Progress:
    """A worker's throttled side reports during an epoch: rank 0's step progress (fire and
    forget, at most every progress_interval_s) and the captured output (acknowledged, at most
    every output_interval_s)."""

    def __init__(self, loop: WorkerLoop, rank: int, capture: OutputCapture) -> None:
        self._loop, self._rank, self._capture = loop, rank, capture
        self._last_progress, self._last_output = 0.0, time.monotonic()

    def step(self, epoch: int, step: int, loss: torch.Tensor) -> None:
        t, now = self._loop.tunables.training, time.monotonic()
        if self._rank == 0 and now - self._last_progress > t.progress_interval_s:
            self._last_progress = now
            self._loop.reporter.step.remote(epoch=epoch, step=step, loss=float(loss.detach()))
        if now - self._last_output > t.output_interval_s and self._capture.pending():
            self.flush()

    def flush(self) -> None:
        send_output(self._loop.reporter, self._rank, self._capture, self._loop.tunables.training.output_ack_timeout_s)
        self._last_output = time.monotonic()


def _train(loop: WorkerLoop, capture: OutputCapture) -> None:
    t, spec = loop.tunables.training, loop.spec
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(spec.cpus_per_worker)))

    model = build_model(spec.model, spec.seed)
    start = _start(model, loop)
    ray.get(loop.reporter.worker_started.remote(
        rank=rank, world_size=world, pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id(),
        resumed_epoch=start.epoch if start.resumed else None,
        node_ip=ray.util.get_node_ip_address(), iface=os.environ.get("GLOO_SOCKET_IFNAME"),
    ), timeout=t.ack_timeout_s)
    if rank == 0 and start.history:
        ray.get(loop.reporter.history_restored.remote(list(start.history), start.step), timeout=t.ack_timeout_s)

    train, val = load_samples(spec, loop.dataset_path, artifacts.store(loop.tunables.state))
    loader = prepare_data_loader(DataLoader(
        TensorDataset(*train.tensors()), batch_size=spec.batch_size, shuffle=True,
        generator=torch.Generator().manual_seed(spec.seed),
    ))
    model = prepare_model(model)  # moves to the worker's device, wraps in DDP
    device = get_device()
    optimizer = _optimizer(model, spec, start.optimizer_state)
    bare: nn.Module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    sampler = getattr(loader, "sampler", None)

    writer = CheckpointWriter(spec.model, t.checkpoint_wait_s)
    progress = _Progress(loop, rank, capture)
    step = start.step
    history = list(start.history)  # rank 0's: what each checkpoint carries
    for epoch in range(start.epoch, spec.epochs):
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        model.train()
        t0 = time.monotonic()
        epoch_steps = 0
        # [sum of loss * vectors, vectors, rank 0's "this epoch checkpoints"], on the model's
        # device: NCCL reduces CUDA tensors only.
        loss_sum = torch.zeros(3, dtype=torch.float64, device=device)
        for batch in loader:
            xb, yb, mb = _batch(batch)
            out = model(xb) if mb is None else model(xb, mb)
            loss = vector_sq_error(out, yb, mb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            epoch_steps += 1
            n = xb.shape[0] if mb is None else mb.sum()  # vectors the loss averaged over (token vectors)
            loss_sum[0] += loss.detach().double() * n  # stays on the device: no sync per step
            loss_sum[1] += n
            progress.step(epoch, step, loss)
        local_sum, local_n = loss_sum[0].item(), int(loss_sum[1].item())
        last = epoch + 1 == spec.epochs
        if rank == 0:
            loss_sum[2] = float(writer.due(last))
        if world > 1 and dist.is_initialized():
            dist.all_reduce(loss_sum)  # every rank's samples count once; rank 0's decision reaches all
        epoch_loss = float(loss_sum[0].item() / max(loss_sum[1].item(), 1.0))
        checkpointed = bool(loss_sum[2].item())
        epoch_s = time.monotonic() - t0
        eval_loss = evaluate(bare, val, rank, world, spec.batch_size, device)
        # This rank's own view of the epoch, on its stdout (captured for the job's logs).
        print(f"epoch {epoch + 1}/{spec.epochs}: local loss {local_sum / max(local_n, 1):.6g} over {local_n} "
              f"samples in {epoch_steps} steps, {epoch_s:.2f}s; all ranks {epoch_loss:.6g}"
              + (f", eval {eval_loss:.6g}" if eval_loss is not None else ""), flush=True)
        report = EpochReport(epoch=epoch + 1, loss=epoch_loss, step=step, epoch_s=epoch_s, eval_loss=eval_loss,
                             at=time.time())
        history.append(report.entry())
        _end_epoch(loop, rank, report, writer, bare, optimizer, progress, history, checkpointed)


def _end_epoch(loop: WorkerLoop, rank: int, report: EpochReport, writer: CheckpointWriter, bare: nn.Module,
               optimizer: torch.optim.Optimizer, progress: _Progress, history: list[EpochEntry],
               checkpointed: bool) -> None:
    """An epoch that checkpoints (rank 0's decision, the same on every rank) is reported to Ray
    Train on every rank (it is a barrier), rank 0 attaching the checkpoint; then every rank
    sends its output, and rank 0 has the run actor acknowledge the epoch (after its output, so
    the job's log shows the rank's line first). `history`: rank 0's epochs so far, this one
    included (the checkpoint carries them)."""
    if rank != 0:
        if checkpointed:
            ray.train.report(report.metrics(), checkpoint=None, checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
        progress.flush()
        return
    if checkpointed:
        checkpoint = writer.write(bare, optimizer, report.epoch, report.step, history)
        report = dataclasses.replace(report, checkpoint_s=writer.write_s, checkpoint_wait_s=writer.wait_s)
        ray.train.report(report.metrics(), checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=True)
    else:
        report = dataclasses.replace(report, no_checkpoint=writer.skip_reason())
    progress.flush()
    # Acknowledged (bounded), so the run has the epoch before fit() can return. Its checkpoint
    # may still be uploading: a restart then resumes from the epoch before and reports this one
    # again (the history keeps one entry per epoch).
    ray.get(loop.reporter.epoch_done.remote(report), timeout=loop.tunables.training.ack_timeout_s)


def load_samples(spec: JobSpec, dataset_path: str | None,
                 store: artifacts.ArtifactStore) -> tuple[Samples, Samples | None]:
    """(training samples, held-out samples or None) of a job, the same on every rank; an
    uploaded dataset is read through `store`."""
    ds = spec.dataset
    if isinstance(ds, SyntheticDataset):
        x, y = synthetic(spec.model, ds)
        return split(Samples(x, y), ds.validation_fraction)
    assert dataset_path is not None, "an uploaded dataset needs its path"
    train, own_val = load_uploaded(dataset_path, store)
    if own_val is not None and not ds.validation_fraction:
        return train, own_val
    return split(train, ds.validation_fraction)  # the submit refused a fraction next to own val tensors


def evaluate(model: nn.Module, val: Samples | None, rank: int, world: int, batch_size: int,
             device: torch.device) -> float | None:
    """Mean loss over every held-out vector (all ranks' shares, all-reduced); None without
    held-out samples. Collective: every rank must call it."""
    if val is None:
        return None
    share = val.take(slice(rank, None, world))  # disjoint shares, together every sample once
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of loss * vectors, vectors]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(share), batch_size):
            part = share.take(slice(i, i + batch_size))
            xb, yb = part.x.to(device), part.y.to(device)
            mb = None if part.mask is None else part.mask.to(device)
            out = model(xb) if mb is None else model(xb, mb)
            n = xb.shape[0] if mb is None else mb.sum()
            sums[0] += vector_sq_error(out, yb, mb).double() * n
            sums[1] += n
    model.train(was_training)
    if world > 1 and dist.is_initialized():
        dist.all_reduce(sums)
    return float(sums[0].item() / sums[1].item()) if sums[1].item() else None


# Epoch checkpoint dirs: <temp dir>/gangserve-ckpt-<writer pid>-e<epoch>-<random>. Ray Train
# deletes one after it uploaded it; one whose worker was killed first stays behind, and the
# next writer on the node removes it (service.cluster.scratch).
CHECKPOINT_DIR_PREFIX = "gangserve-ckpt-"
_CHECKPOINT_DIR = re.compile(rf"^{re.escape(CHECKPOINT_DIR_PREFIX)}(\d+)-e\d+-")


class CheckpointWriter:
    """Rank 0's epoch checkpoints as local temp dirs for Ray Train's ASYNC upload, at most
    one in flight (see the module docstring)."""

    def __init__(self, spec: ModelSpecT, wait_bound_s: float) -> None:
        """`wait_bound_s`: the longest wait for the previous upload (training.checkpoint_wait_s).
        Removes the checkpoint dirs that dead writers on this node left behind: every rank
        builds one, so a node that now holds only other ranks is cleaned too (one listing
        of the temp dir per worker start)."""
        sweep_dead_owners(Path(tempfile.gettempdir()), _CHECKPOINT_DIR)
        self._spec = spec
        self._wait_bound_s = wait_bound_s
        self._pending: Path | None = None  # the previous epoch's dir until its upload deletes it
        self._written_at = -float("inf")  # monotonic time of the last write
        self.wait_s = 0.0   # the last write's wait for the previous upload
        self.write_s = 0.0  # the last write's own time (local files)

    def write(self, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, step: int,
              history: list[EpochEntry]) -> ray.train.Checkpoint:
        """The epoch's checkpoint dir: the model, and the train state (epoch, step, optimizer,
        `history`: the job's epochs up to this one)."""
        t0 = time.monotonic()
        self.wait()
        t1 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f"{CHECKPOINT_DIR_PREFIX}{os.getpid()}-e{epoch}-"))
        save_model(model, self._spec, tmp / MODEL_FILE)
        torch.save({"epoch": epoch, "step": step, "optimizer": optimizer.state_dict(),
                    "history": [dataclasses.asdict(entry) for entry in history]}, tmp / TRAIN_STATE_FILE)
        self._pending, self._written_at = tmp, time.monotonic()
        self.wait_s, self.write_s = t1 - t0, time.monotonic() - t1
        return ray.train.Checkpoint.from_directory(str(tmp))

    def busy(self) -> bool:
        """Whether the previous checkpoint is still being uploaded."""
        return self._pending is not None and self._pending.exists()

    def due(self, last: bool) -> bool:
        """Whether this epoch writes a checkpoint: the last epoch always (it waits for the
        previous upload); another when no upload is in flight and the previous checkpoint is
        at least REPORT_INTERVAL_S old (the first of this writer always)."""
        if last:
            return True
        return not self.busy() and time.monotonic() - self._written_at >= REPORT_INTERVAL_S

    def skip_reason(self) -> str:
        """Why `due` said no (for the epoch's log line)."""
        if self.busy():
            return "the previous one is still uploading"
        return (f"the previous one is {time.monotonic() - self._written_at:.1f}s old; one per "
                f"{REPORT_INTERVAL_S:g}s, Ray Train's look at its workers")

    def wait(self) -> None:
        """Until the previous upload finished (Ray Train deletes the dir after uploading it)."""
        if self._pending is None:
            return
        deadline = time.monotonic() + self._wait_bound_s
        while self._pending.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the checkpoint upload of {self._pending.name} did not finish within "
                                   f"{self._wait_bound_s:.0f}s (storage too slow or unreachable)")
            time.sleep(0.01)
        self._pending = None
