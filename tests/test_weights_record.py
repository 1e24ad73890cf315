"""The served-weights record on its own (no Ray): versions, the config rule, immutable copies."""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from service.config import ModelConfig
from service.weights.record import (
    WeightsRecord,
    WeightsRecordError,
    describe_config_weights,
    store_immutable_copy,
    verify_recorded_file,
)

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
