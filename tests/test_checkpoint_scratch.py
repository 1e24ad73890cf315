"""Rank 0's epoch checkpoints (service.training.runner.CheckpointWriter): uploaded to the
artifact store and registered (service.training.epoch_checkpoints), the newest two kept. Dirs
left on a node by a killed training worker are removed by the next writer there
(service.cluster.scratch); a live writer's dirs and anything else in the temp dir are left
alone. A checkpoint's train state carries the job's history up to its epoch, which a resumed
run restores."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from service.training.models import build_model
from service.training.run_snapshot import EpochEntry
from service.state.artifacts import ArtifactStore, open_store
from service.training.epoch_checkpoints import EpochCheckpoint, latest
from service.training.runner import CHECKPOINT_DIR_PREFIX, CheckpointWriter, read_train_state
from service.training.spec import LinearModel
from tests.helpers import pid_alive

pytestmark = pytest.mark.unit


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)
    return child.pid


def _store(tmp_path: Path) -> ArtifactStore:
    return open_store(None, local_state=tmp_path / "state")


def test_a_new_writer_removes_dead_writers_checkpoint_dirs_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    dead = scratch / f"{CHECKPOINT_DIR_PREFIX}{_dead_pid()}-e3-abc123"
    live = scratch / f"{CHECKPOINT_DIR_PREFIX}{os.getppid()}-e1-def456"  # pytest's parent: alive
    unrelated = [scratch / "gangserve-ckpt-e2-old", scratch / "other-dir"]
    for d in (dead, live, *unrelated):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 16)

    spec, store = LinearModel(), _store(tmp_path)
    writer = CheckpointWriter(store, "job-1", spec, wait_bound_s=5.0, resumed_from=None)
    assert not dead.exists()
    assert live.exists() and all(d.exists() for d in unrelated)

    # Its own dir is uploaded, registered and removed.
    model = build_model(spec, 0)
    writer.write(model, torch.optim.SGD(model.parameters(), lr=0.1), epoch=1, step=4, history=[])
    writer.wait()
    assert latest(store, "job-1") == EpochCheckpoint("job-1", 1)
    assert store.exists("runs/job-1/epoch-000001/model.safetensors") and store.exists("runs/job-1/epoch-000001/train_state.pt")
    assert not [p for p in scratch.iterdir() if p.name.startswith(f"{CHECKPOINT_DIR_PREFIX}{os.getpid()}-")]


def test_a_checkpoint_carries_the_history_up_to_its_epoch(tmp_path: Path) -> None:
    """What a resumed run hands back to its run actor: the epochs its checkpoint stands on,
    with the step count and the optimizer's state; a train state written before checkpoints
    carried a history reads with none."""
    spec, store = LinearModel(), _store(tmp_path)
    model = build_model(spec, 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 10)).sum().backward()
    optimizer.step()
    history = [EpochEntry(1, 0.5, 0.75, 1_000.0), EpochEntry(2, 0.25, None, 1_002.5)]
    writer = CheckpointWriter(store, "job-2", spec, wait_bound_s=5.0, resumed_from=None)
    writer.write(model, optimizer, epoch=2, step=8, history=history)
    writer.wait()

    checkpoint = latest(store, "job-2")
    assert checkpoint is not None
    start = read_train_state(store.read_bytes(checkpoint.state_key), checkpoint)
    assert (start.epoch, start.step, start.resumed_from) == (2, 8, checkpoint)
    assert start.history == tuple(history)
    exp_avg = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(start.optimizer_state["state"][0]["exp_avg"], exp_avg)

    buffer = io.BytesIO()
    torch.save({"epoch": 3, "step": 12, "optimizer": optimizer.state_dict()}, buffer)
    assert read_train_state(buffer.getvalue(), checkpoint).history == ()


def test_the_two_newest_checkpoints_are_kept_across_a_resume(tmp_path: Path) -> None:
    """A writer keeps the KEEP newest epochs it registered (the one its group resumed from
    counts among them); the pointer names the newest."""
    spec, store = LinearModel(), _store(tmp_path)
    model = build_model(spec, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def epochs_stored() -> list[str]:
        return sorted(p.name for p in (Path(store.root) / "runs" / "job-3").iterdir() if p.is_dir())

    writer = CheckpointWriter(store, "job-3", spec, wait_bound_s=5.0, resumed_from=None)
    for epoch in (1, 2, 3, 4):
        writer.write(model, optimizer, epoch=epoch, step=epoch, history=[])
        writer.wait()
    assert epochs_stored() == ["epoch-000003", "epoch-000004"] and latest(store, "job-3") == EpochCheckpoint("job-3", 4)

    resumed = CheckpointWriter(store, "job-3", spec, wait_bound_s=5.0, resumed_from=latest(store, "job-3"))
    resumed.write(model, optimizer, epoch=5, step=5, history=[])
    resumed.wait()
    # The newest two: the resumed-from epoch 4 and the new 5; epoch 3 goes with them only by
    # the first writer's count, so it stays until the job's run prefix is deleted.
    assert "epoch-000004" in epochs_stored() and "epoch-000005" in epochs_stored()
    assert latest(store, "job-3") == EpochCheckpoint("job-3", 5)


def test_a_pointer_that_is_not_ours_is_no_checkpoint(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert latest(store, "job-4") is None
    store.write_bytes("runs/job-4/latest.json", b"not json")
    assert latest(store, "job-4") is None
    store.write_bytes("runs/job-4/latest.json", json.dumps({"epoch": 2}).encode())
    assert latest(store, "job-4") == EpochCheckpoint("job-4", 2)
