"""One DDP rank of a training run: what a `TrainWorker` actor runs, and its train loop.

A run's worker group (service.training.worker_group) places one `TrainWorker` per rank and
calls, in order: rank 0's `open_store` (the rendezvous store, on its node, OS-chosen port),
then every rank's `run_rank`, which joins the process group (gloo on CPU, NCCL on GPUs; bound
to its node's interface, service.cluster.netif; the rendezvous and every collective bounded
by training.group_timeout_s) and runs the loop:

    DistributedDataParallel over the model (world size > 1), a DistributedSampler over the
    training samples (set_epoch every epoch, so shuffles differ), the squared error, the
    optimizer; after each epoch the all-reduced loss, the held-out loss, rank 0's report
    to the run actor, and rank 0's checkpoint when one is due.

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

Where a worker group starts: the run's newest registered epoch checkpoint
(service.training.epoch_checkpoints: a group that replaces a failed one, or a run resumed
after the service restarted), else the job's `init_key` (its copy of its `init_from`
weights), else the seeded random init. A checkpoint carries the history: every epoch's entry
up to its own. A resumed group's rank 0 hands them to the run actor (`history_restored`)
before its first step, so the job's history holds every epoch the checkpoint stands on even
when the run that finished one died before recording it.

Validation: after each epoch's steps every rank evaluates its share (rank r: samples r, r +
world, ...) of the held-out samples with the bare module, no gradients; the sums are
all-reduced, so `eval_loss` is the exact mean over all held-out vectors (same loss as
training). None when the job holds out nothing.

Checkpoints off the step path: rank 0 writes the epoch's files to a local temp dir (a
memory-speed write of the model and optimizer state) and one upload thread copies them to the
store and registers them while the next epoch trains, then deletes the temp dir. At most one
upload is in flight: an epoch that ends while the previous upload still runs writes no
checkpoint (the steps never wait for storage), except the last epoch, which waits for the
previous upload (at most training.checkpoint_wait_s), writes the final one and waits for it.
Bound on lost work: a crash loses the epochs since the newest registered checkpoint, at most
ceil(upload time / epoch time) + 1 epochs. Each epoch's metrics carry rank 0's time on the step
path: `checkpoint_s` writing the local files and `checkpoint_wait_s` waiting for the previous
upload (non-zero only at the last epoch), both None for an epoch without a checkpoint
(`no_checkpoint` says why). Only rank 0 checkpoints (DDP keeps the replicas equal), so no other
rank waits for it.
"""
from __future__ import annotations

import dataclasses
import io
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from safetensors.torch import load as st_load_torch

from service.cluster.netif import bind_ray_worker
from service.cluster.scratch import sweep_dead_owners
from service.state import artifacts
from service.training.checkpoints import MODEL_FILE
from service.training.datasets import Samples, load_uploaded, split, synthetic
from service.training.epoch_checkpoints import TRAIN_STATE_FILE, EpochCheckpoint, latest, register
from service.training.models import build_model, load_tensors, save_model
from service.training.run_snapshot import EpochEntry
from service.training.spec import JobSpec, ModelSpecT, SyntheticDataset
from service.training.worker_output import OutputCapture
from service.training.worker_reports import EpochReport, WorkerLoop


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


@dataclass(frozen=True)
class WorkerPlace:
    """Where a rank runs: its rank, the group's size, and its torch device."""

    rank: int
    world: int
    device: torch.device


def open_store(world: int, timeout_s: float) -> tuple[dist.TCPStore, tuple[str, int]]:
    """Rank 0's rendezvous store for a group of `world`, hosted on this node's Ray address (the
    one other nodes reach it at) at an OS-chosen port; the store and its (address, port)."""
    host = ray.util.get_node_ip_address()
    store = dist.TCPStore(host, 0, world, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, (host, int(store.port))


def run_rank(loop: WorkerLoop, rank: int, world: int, rendezvous: tuple[str, int],
             store: dist.TCPStore | None) -> None:
    """Join the process group at `rendezvous` (rank 0 passes the `store` it hosts) and train;
    raises what the loop raised. The rank's output is captured throughout and sent at the end."""
    capture = OutputCapture(loop.tunables.training)
    with capture.installed():
        try:
            place = _join(loop, rank, world, rendezvous, store)
            try:
                _train(loop, place, capture)
            finally:
                dist.destroy_process_group()
        finally:
            send_output(loop.reporter, rank, capture, loop.tunables.training.output_ack_timeout_s, final=True)


def _join(loop: WorkerLoop, rank: int, world: int, rendezvous: tuple[str, int],
          store: dist.TCPStore | None) -> WorkerPlace:
    # The interface of this node's Ray IP, before the group exists (service.cluster.netif).
    bind_ray_worker()
    cuda = loop.spec.use_gpu and torch.cuda.is_available()
    # Ray gives an actor with a GPU its own CUDA_VISIBLE_DEVICES: the one device it sees.
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    timeout = timedelta(seconds=loop.tunables.training.group_timeout_s)
    host, port = rendezvous
    store = store or dist.TCPStore(host, port, world, False, timeout)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return WorkerPlace(rank, world, device)


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


@dataclass(frozen=True)
class _Start:
    """Where a worker's training starts: epoch and step counts, and the optimizer's state."""

    epoch: int
    step: int
    optimizer_state: dict[str, Any] | None
    resumed_from: EpochCheckpoint | None  # the run's checkpoint it starts from; None: a fresh start
    history: tuple[EpochEntry, ...] = ()  # the checkpoint's epochs 1..epoch


def _start(model: nn.Module, loop: WorkerLoop, store: artifacts.ArtifactStore) -> _Start:
    """Loads `model`'s weights where the worker group starts from: the run's newest registered
    checkpoint, else the job's init_from weights, else the seeded init `model` already holds."""
    spec = loop.spec
    restored = latest(store, loop.job_id)
    if restored is not None:
        load_tensors(model, spec.model, st_load_torch(store.read_bytes(restored.model_key)))
        return read_train_state(store.read_bytes(restored.state_key), restored)
    if loop.init_key:
        # Fine-tuning: the job's own copy of its init_from weights (shapes checked at submit).
        load_tensors(model, spec.model, st_load_torch(store.read_bytes(loop.init_key)))
    return _Start(0, 0, None, resumed_from=None)


def read_train_state(data: bytes, checkpoint: EpochCheckpoint) -> _Start:
    """Where a checkpoint's train_state.pt (CheckpointWriter.write) resumes the run."""
    # map_location: the optimizer state was saved from whichever cuda:N that worker had;
    # load it on the CPU (load_state_dict moves it to the parameters' device).
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    history = tuple(EpochEntry(**entry) for entry in state.get("history", ()))
    return _Start(int(state["epoch"]), int(state["step"]), state["optimizer"], resumed_from=checkpoint,
                  history=history)


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


def _loader(train: Samples, spec: JobSpec, place: WorkerPlace) -> tuple[DataLoader, DistributedSampler | None]:
    """The rank's batches: with more than one rank, its share of a seeded shuffle of every
    sample (DistributedSampler: disjoint shares, padded to equal length); alone, all of them."""
    dataset = TensorDataset(*train.tensors())
    if place.world == 1:
        return DataLoader(dataset, batch_size=spec.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(spec.seed)), None
    sampler = DistributedSampler(dataset, num_replicas=place.world, rank=place.rank, shuffle=True, seed=spec.seed)
    return DataLoader(dataset, batch_size=spec.batch_size, sampler=sampler), sampler


def _steps(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer, progress: _Progress,
           epoch: int, step: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """One epoch's optimizer steps over this rank's batches (`step`: the count before them);
    returns ([sum of loss * vectors, vectors] on the model's device, steps taken). The sums stay
    on the device, no sync per step; NCCL reduces CUDA tensors only."""
    loss_sum = torch.zeros(2, dtype=torch.float64, device=device)
    steps = 0
    for batch in loader:
        xb, yb, mb = (part.to(device) if part is not None else None for part in _batch(batch))
        out = model(xb) if mb is None else model(xb, mb)
        loss = vector_sq_error(out, yb, mb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps += 1
        n = xb.shape[0] if mb is None else mb.sum()  # vectors the loss averaged over (token vectors)
        loss_sum[0] += loss.detach().double() * n
        loss_sum[1] += n
        progress.step(epoch, step + steps, loss)
    return loss_sum, steps


def _train(loop: WorkerLoop, place: WorkerPlace, capture: OutputCapture) -> None:
    t, spec = loop.tunables.training, loop.spec
    rank, world, device = place.rank, place.world, place.device
    torch.set_num_threads(max(1, int(spec.cpus_per_worker)))
    store = artifacts.store(loop.tunables.state)

    model = build_model(spec.model, spec.seed)
    start = _start(model, loop, store)
    ray.get(loop.reporter.worker_started.remote(
        rank=rank, world_size=world, pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id(),
        resumed_epoch=start.resumed_from.epoch if start.resumed_from else None,
        node_ip=ray.util.get_node_ip_address(), iface=os.environ.get("GLOO_SOCKET_IFNAME"),
    ), timeout=t.ack_timeout_s)
    if rank == 0 and start.history:
        ray.get(loop.reporter.history_restored.remote(list(start.history), start.step), timeout=t.ack_timeout_s)

    train, val = load_samples(spec, loop.dataset_path, store)
    loader, sampler = _loader(train, spec, place)
    bare = model.to(device)
    model = (nn.parallel.DistributedDataParallel(bare, device_ids=[device.index] if device.type == "cuda" else None)
             if world > 1 else bare)
    optimizer = _optimizer(model, spec, start.optimizer_state)

    writer = CheckpointWriter(store, loop.job_id, spec.model, t.checkpoint_wait_s, start.resumed_from) if rank == 0 else None
    progress = _Progress(loop, rank, capture)
    step = start.step
    history = list(start.history)  # rank 0's: what each checkpoint carries
    for epoch in range(start.epoch, spec.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        t0 = time.monotonic()
        loss_sum, epoch_steps = _steps(model, loader, optimizer, progress, epoch, step, device)
        step += epoch_steps
        local_sum, local_n = loss_sum[0].item(), int(loss_sum[1].item())
        if world > 1:
            dist.all_reduce(loss_sum)  # every rank's samples count once
        epoch_loss = float(loss_sum[0].item() / max(loss_sum[1].item(), 1.0))
        epoch_s = time.monotonic() - t0
        eval_loss = evaluate(bare, val, rank, world, spec.batch_size, device)
        # This rank's own view of the epoch, on its stdout (captured for the job's logs).
        print(f"epoch {epoch + 1}/{spec.epochs}: local loss {local_sum / max(local_n, 1):.6g} over {local_n} "
              f"samples in {epoch_steps} steps, {epoch_s:.2f}s; all ranks {epoch_loss:.6g}"
              + (f", eval {eval_loss:.6g}" if eval_loss is not None else ""), flush=True)
        report = EpochReport(epoch=epoch + 1, loss=epoch_loss, step=step, epoch_s=epoch_s, eval_loss=eval_loss,
                             at=time.time())
        history.append(report.entry())
        _end_epoch(loop, report, writer, bare, optimizer, progress, history, last=epoch + 1 == spec.epochs)


def _end_epoch(loop: WorkerLoop, report: EpochReport, writer: CheckpointWriter | None, bare: nn.Module,
               optimizer: torch.optim.Optimizer, progress: _Progress, history: list[EpochEntry],
               last: bool) -> None:
    """Every rank sends its output; rank 0 (the one with a `writer`) first writes the epoch's
    checkpoint when one is due (the last epoch's is waited for: the run's final checkpoint),
    then has the run actor acknowledge the epoch (after its output, so the job's log shows the
    rank's line first). `history`: rank 0's epochs so far, this one included (the checkpoint
    carries them)."""
    if writer is None:
        progress.flush()
        return
    if writer.due(last):
        writer.write(bare, optimizer, report.epoch, report.step, history)
        report = dataclasses.replace(report, checkpoint_s=writer.write_s, checkpoint_wait_s=writer.wait_s)
        if last:
            writer.wait()
    else:
        report = dataclasses.replace(report, no_checkpoint=writer.skip_reason())
    progress.flush()
    # Acknowledged (bounded), so the run has the epoch before the group's attempt ends. Its
    # checkpoint may still be uploading: a restart then resumes from the epoch before and
    # reports this one again (the history keeps one entry per epoch).
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


# Epoch checkpoint dirs: <temp dir>/gangserve-ckpt-<writer pid>-e<epoch>-<random>. The upload
# thread deletes one after it uploaded it; one whose worker was killed first stays behind, and
# the next writer on the node removes it (service.cluster.scratch).
CHECKPOINT_DIR_PREFIX = "gangserve-ckpt-"
_CHECKPOINT_DIR = re.compile(rf"^{re.escape(CHECKPOINT_DIR_PREFIX)}(\d+)-e\d+-")


class CheckpointWriter:
    """Rank 0's epoch checkpoints: local temp dirs, uploaded to the store and registered by
    one background thread, at most one in flight (see the module docstring)."""

    def __init__(self, store: artifacts.ArtifactStore, job_id: str, spec: ModelSpecT, wait_bound_s: float,
                 resumed_from: EpochCheckpoint | None) -> None:
        """`wait_bound_s`: the longest wait for an upload (training.checkpoint_wait_s).
        `resumed_from`: the checkpoint this group started from (kept, then pruned like the
        writer's own). Removes the checkpoint dirs that dead writers on this node left behind."""
        sweep_dead_owners(Path(tempfile.gettempdir()), _CHECKPOINT_DIR)
        self._store, self._job_id, self._spec = store, job_id, spec
        self._wait_bound_s = wait_bound_s
        self._registered: list[EpochCheckpoint] = [resumed_from] if resumed_from else []
        self._upload: threading.Thread | None = None
        self._failed: BaseException | None = None  # the last upload's error, raised by the next wait
        self.wait_s = 0.0   # the last write's wait for the previous upload
        self.write_s = 0.0  # the last write's own time (local files)

    def write(self, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, step: int,
              history: list[EpochEntry]) -> None:
        """Write the epoch's checkpoint (the model, and the train state: epoch, step, optimizer,
        `history`: the job's epochs up to this one) locally and start its upload."""
        t0 = time.monotonic()
        self.wait()
        t1 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f"{CHECKPOINT_DIR_PREFIX}{os.getpid()}-e{epoch}-"))
        save_model(model, self._spec, tmp / MODEL_FILE)
        torch.save({"epoch": epoch, "step": step, "optimizer": optimizer.state_dict(),
                    "history": [dataclasses.asdict(entry) for entry in history]}, tmp / TRAIN_STATE_FILE)
        self.wait_s, self.write_s = t1 - t0, time.monotonic() - t1
        self._upload = threading.Thread(target=self._upload_and_register, args=(tmp, EpochCheckpoint(self._job_id, epoch)),
                                        name=f"checkpoint-e{epoch}", daemon=True)
        self._upload.start()

    def _upload_and_register(self, tmp: Path, checkpoint: EpochCheckpoint) -> None:
        try:
            self._store.put_file(checkpoint.model_key, tmp / MODEL_FILE)
            self._store.put_file(checkpoint.state_key, tmp / TRAIN_STATE_FILE)
            register(self._store, checkpoint, self._registered)
        except BaseException as exc:  # noqa: BLE001 - raised on the step path by the next wait
            self._failed = exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def busy(self) -> bool:
        """Whether the previous checkpoint is still being uploaded."""
        return self._upload is not None and self._upload.is_alive()

    def due(self, last: bool) -> bool:
        """Whether this epoch writes a checkpoint: the last epoch always (it waits for the
        previous upload), another when no upload is in flight."""
        return last or not self.busy()

    def skip_reason(self) -> str:
        """Why `due` said no (for the epoch's log line)."""
        return "the previous one is still uploading"

    def wait(self) -> None:
        """Until the previous upload finished and was registered; raises its error, or one
        naming the storage when it took longer than the bound."""
        if self._upload is not None:
            self._upload.join(self._wait_bound_s)
            if self._upload.is_alive():
                raise RuntimeError(f"the checkpoint upload ({self._upload.name}) to {self._store.url} did not finish "
                                   f"within {self._wait_bound_s:.0f}s (storage too slow or unreachable)")
            self._upload = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise RuntimeError(f"the checkpoint upload to {self._store.url} failed: {failed}") from failed
