"""Weight init, checkpoint format and per-rank slicing."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from service.parallel.attention import AttentionDef
from service.parallel.model import check_checkpoint, load_checkpoint_shard
from service.parallel.weights import (
    random_weights,
    save_checkpoint,
    seed_weights,
    shard_dense,
)
from tests.reference import notes_seed_weights

pytestmark = pytest.mark.unit


def test_seed_init_reproduces_the_notes_bit_for_bit() -> None:
    ours, theirs = seed_weights(64), notes_seed_weights(64)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    # Spot-check the formula itself: W[i, j] = i * E + j + offset.
    assert ours["k_proj.weight"][3, 5].item() == pytest.approx(3 * 64 + 5 - 0.2, abs=1e-4)
    assert ours["out_proj.bias"][7].item() == pytest.approx(7 - 0.4, abs=1e-5)


def test_random_init_is_reproducible_and_seed_dependent() -> None:
    a, b, c = random_weights(32, 1), random_weights(32, 1), random_weights(32, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["q_proj.weight"], c["q_proj.weight"])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_checkpoint_slices_equal_dense_slices(tmp_path: Path, world_size: int) -> None:
    dense = random_weights(64, 5)
    path = tmp_path / "w.safetensors"
    save_checkpoint(path, dense, num_heads=8)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"embed_dim": "64", "num_heads": "8"}
        assert set(f.keys()) == set(dense)
    for rank in range(world_size):
        from_file = load_checkpoint_shard(AttentionDef(64, 8), path, rank, world_size)
        from_dense = shard_dense(dense, rank, world_size)
        for key in from_dense:
            assert torch.equal(from_file[key], from_dense[key]), (rank, key)
    # q rows of rank 1 of 2 are rows 32..63 of the dense matrix; out columns likewise.
    if world_size == 2:
        s = load_checkpoint_shard(AttentionDef(64, 8), path, 1, 2)
        assert torch.equal(s["q_proj.weight"], dense["q_proj.weight"][32:])
        assert torch.equal(s["out_proj.weight"], dense["out_proj.weight"][:, 32:])
        assert torch.equal(s["out_proj.bias"], dense["out_proj.bias"])


def test_check_checkpoint_names_the_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_checkpoint(path, random_weights(64, 0), num_heads=8)
    check_checkpoint(AttentionDef(64, 8), path)
    with pytest.raises(ValueError, match=r"metadata embed_dim=64, the model needs 512.*q_proj.weight has shape \[64, 64\], "
                       r"the model needs \[512, 512\]"):
        check_checkpoint(AttentionDef(512, 8), path)
