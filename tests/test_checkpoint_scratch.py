"""Epoch checkpoint dirs left on a node by a killed training worker are removed by the next
writer there (service.training.runner.CheckpointWriter, service.cluster.scratch); a live writer's
dirs and anything else in the temp dir are left alone. A checkpoint's train state carries the
job's history up to its epoch, which a resumed run restores."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from service.training.models import build_model
from service.training.run_snapshot import EpochEntry
from service.training.runner import CHECKPOINT_DIR_PREFIX, TRAIN_STATE_FILE, CheckpointWriter, read_train_state
from service.training.spec import LinearModel
from tests.helpers import pid_alive

pytestmark = pytest.mark.unit


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)
    return child.pid


def test_a_new_writer_removes_dead_writers_checkpoint_dirs_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"{CHECKPOINT_DIR_PREFIX}{_dead_pid()}-e3-abc123"
    live = tmp_path / f"{CHECKPOINT_DIR_PREFIX}{os.getppid()}-e1-def456"  # pytest's parent: alive
    unrelated = [tmp_path / "gangserve-ckpt-e2-old", tmp_path / "other-dir"]
    for d in (dead, live, *unrelated):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 16)

    spec = LinearModel()
    writer = CheckpointWriter(spec, wait_bound_s=5.0)
    assert not dead.exists()
    assert live.exists() and all(d.exists() for d in unrelated)

    # Its own dirs carry its pid, so the writer after it leaves them while it lives.
    model = build_model(spec, 0)
    checkpoint = writer.write(model, torch.optim.SGD(model.parameters(), lr=0.1), epoch=1, step=4, history=[])
    mine = Path(checkpoint.path)
    assert mine.parent == tmp_path and mine.name.startswith(f"{CHECKPOINT_DIR_PREFIX}{os.getpid()}-e1-"), mine
    assert sorted(p.name for p in mine.iterdir()) == ["model.safetensors", "train_state.pt"]
    CheckpointWriter(spec, wait_bound_s=5.0)
    assert mine.exists()


def test_a_checkpoint_carries_the_history_up_to_its_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a resumed run hands back to its run actor: the epochs its checkpoint stands on,
    with the step count and the optimizer's state; a train state written before checkpoints
    carried a history reads with none."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spec = LinearModel()
    model = build_model(spec, 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 10)).sum().backward()
    optimizer.step()
    history = [EpochEntry(1, 0.5, 0.75, 1_000.0), EpochEntry(2, 0.25, None, 1_002.5)]
    checkpoint = CheckpointWriter(spec, wait_bound_s=5.0).write(model, optimizer, epoch=2, step=8, history=history)

    start = read_train_state(Path(checkpoint.path) / TRAIN_STATE_FILE)
    assert (start.epoch, start.step, start.resumed) == (2, 8, True)
    assert start.history == tuple(history)
    exp_avg = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(start.optimizer_state["state"][0]["exp_avg"], exp_avg)

    older = tmp_path / "older.pt"
    torch.save({"epoch": 3, "step": 12, "optimizer": optimizer.state_dict()}, older)
    assert read_train_state(older).history == ()
