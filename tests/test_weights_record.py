"""The served-weights record on its own (no Ray): versions, the config rule, immutable copies."""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from service.config.builder_args import ModelConfig
from service.weights.declared import describe_config_weights
from service.weights.record import WeightsRecord
from service.weights.served import WeightsRecordError, store_immutable_copy, verify_recorded_file

pytestmark = pytest.mark.unit


def _checkpoint(path: Path, seed: int, embed_dim: int = 16) -> Path:
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"{p}.{k}": torch.randn(*((embed_dim, embed_dim) if k == "weight" else (embed_dim,)), generator=gen)
               for p in ("q_proj", "k_proj", "v_proj", "out_proj") for k in ("weight", "bias")}
    save_file(tensors, str(path), metadata={"embed_dim": str(embed_dim), "num_heads": "4"})
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_first_start_records_the_config_and_a_restart_keeps_a_swap(tmp_path: Path, store_url: str) -> None:
    record = WeightsRecord(tmp_path, store_url)
    config = describe_config_weights(ModelConfig(embed_dim=16, num_heads=4, init="random", seed=1))
    first = record.reconcile("app", config)
    assert (first.version, first.source, first.description) == (1, "config", "init=random seed=1")
    assert record.reconcile("app", config) == first  # same config: nothing new

    stored, sha = store_immutable_copy(_checkpoint(tmp_path / "a.safetensors", 0), tmp_path)
    swap = record.record("app", "swap", "checkpoint a.safetensors", sha256=sha,
                         fingerprint=config.fingerprint, checkpoint=stored)
    assert swap.version == 2
    # A restart (a new connection, as a new replica would open) with the same config serves the swap.
    reopened = WeightsRecord(tmp_path, store_url)
    assert reopened.reconcile("app", config) == swap
    reopened.close()
    # Another app on the same state dir has its own versions.
    assert record.reconcile("other", config).version == 1
    record.close()


def test_a_changed_config_wins_and_supersedes_older_versions(tmp_path: Path, store_url: str) -> None:
    record = WeightsRecord(tmp_path, store_url)
    old = describe_config_weights(ModelConfig(embed_dim=16, num_heads=4, init="random", seed=1))
    record.reconcile("app", old)
    record.record("app", "swap", "x", sha256="0" * 64, fingerprint=old.fingerprint, checkpoint=None)
    new = describe_config_weights(ModelConfig(embed_dim=16, num_heads=4, init="random", seed=2))
    assert new.fingerprint != old.fingerprint
    won = record.reconcile("app", new)
    assert (won.version, won.source, won.description) == (3, "config", "init=random seed=2")
    history = record.history("app")
    assert [w.superseded_at is not None for w in history] == [True, True, False]
    # Going back to the old config is a change too: versions still only grow.
    assert record.reconcile("app", old).version == 4
    record.close()


def test_a_configured_checkpoint_rewritten_in_place_counts_as_a_changed_config(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "w.safetensors", 0)
    model = ModelConfig(embed_dim=16, num_heads=4, checkpoint=str(path))
    before = describe_config_weights(model)
    assert before.sha256 == _sha(path) and before.description == "checkpoint w.safetensors"
    _checkpoint(path, 1)
    after = describe_config_weights(model)
    assert after.sha256 == _sha(path) != before.sha256 and after.fingerprint != before.fingerprint


def test_immutable_copy_is_content_addressed_read_only_and_verified(tmp_path: Path, store_url: str) -> None:
    src = _checkpoint(tmp_path / "a.safetensors", 3)
    stored, sha = store_immutable_copy(src, tmp_path)
    copy = tmp_path / stored
    assert stored == f"weights/{sha}.safetensors" and sha == _sha(src) and copy.read_bytes() == src.read_bytes()
    assert oct(copy.stat().st_mode & 0o777) == "0o444"
    assert store_immutable_copy(src, tmp_path) == (stored, sha)  # same content: same file
    src.unlink()  # the job or file it came from may go away
    record = WeightsRecord(tmp_path, store_url)
    weights = record.record("app", "swap", "a", sha256=sha, fingerprint="f", checkpoint=stored)
    verify_recorded_file(weights, tmp_path)
    os.chmod(copy, 0o644)
    copy.write_bytes(copy.read_bytes()[:-8])
    with pytest.raises(WeightsRecordError, match="refusing to serve altered weights"):
        verify_recorded_file(weights, tmp_path)
    copy.unlink()
    with pytest.raises(WeightsRecordError, match="cannot be read"):
        verify_recorded_file(weights, tmp_path)
    assert not [p for p in (tmp_path / "weights").iterdir() if p.name.startswith(".incoming")]
    record.close()


def test_concurrent_writers_never_reuse_a_version(tmp_path: Path, store_url: str) -> None:
    """Several replicas (one store each = one writer each) recording at once get distinct,
    consecutive versions, on SQLite and PostgreSQL."""
    WeightsRecord(tmp_path, store_url).close()  # schema
    versions: list[int] = []
    lock = threading.Lock()

    def writer(i: int) -> None:
        record = WeightsRecord(tmp_path, store_url)
        for j in range(10):
            v = record.record("app", "swap", f"{i}-{j}", sha256="0" * 64, fingerprint="f", checkpoint=None).version
            with lock:
                versions.append(v)
        record.close()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(versions) == list(range(1, 41))


def test_versions_keep_eval_loss_and_rollbacks_name_what_they_served_again(tmp_path: Path, store_url: str) -> None:
    record = WeightsRecord(tmp_path, store_url)
    config = describe_config_weights(ModelConfig(embed_dim=16, num_heads=4, init="random", seed=1))
    first = record.reconcile("app", config)
    stored, sha = store_immutable_copy(_checkpoint(tmp_path / "a.safetensors", 0), tmp_path)
    swap = record.record("app", "swap", "job job-a", sha256=sha, fingerprint=config.fingerprint,
                         checkpoint=stored, job_id="job-a", eval_loss=0.25)
    back = record.record("app", "config", f"rollback of 1: {first.description}", sha256=first.sha256,
                         fingerprint=config.fingerprint, checkpoint=None, rollback_of=1)
    assert (swap.version, swap.eval_loss, swap.rollback_of) == (2, 0.25, None)
    assert (back.version, back.rollback_of, back.sha256) == (3, 1, first.sha256)
    assert record.version("app", 2) == swap and record.version("app", 9) is None and record.version("other", 1) is None
    assert record.current("app") == back
    # A restart with the same config serves the rollback (the newest row), as any swap.
    reopened = WeightsRecord(tmp_path, store_url)
    assert reopened.reconcile("app", config) == back
    reopened.close()
    record.close()


@pytest.mark.parametrize(("job", "bound", "refused"), [
    ({"id": "job-a", "final_eval_loss": 0.5}, None, None),            # no gate
    ({"id": "job-a", "final_eval_loss": 0.5}, 0.5, None),             # at the bound: passes
    ({"id": "job-a", "final_eval_loss": 0.5}, 0.75, None),
    ({"id": "job-a", "final_eval_loss": 0.5}, 0.25, "final eval loss 0.5 is above max_eval_loss=0.25"),
    ({"id": "job-a", "final_eval_loss": None}, 1e9, "job job-a has no eval loss"),
    ({"id": "job-a"}, 1e9, "job job-a has no eval loss"),             # a record from before validation
    ({"id": "job-a", "final_eval_loss": float("nan")}, 1e9, "nan is above"),
])
def test_the_eval_gate_refuses_above_the_bound_and_without_an_eval_loss(
        job: dict, bound: float | None, refused: str | None) -> None:
    from service.contract.errors import Conflict
    from service.weights.gate import check_eval_gate

    if refused is None:
        check_eval_gate(job, bound)
        return
    with pytest.raises(Conflict, match=refused) as info:
        check_eval_gate(job, bound)
    assert (info.value.status, info.value.code) == (409, "eval_gate")
