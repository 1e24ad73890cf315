"""Tensor-parallel attention vs an independent dense reference, real gloo groups (no Ray)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from service.parallel.weights import random_weights, seed_weights
from tests.reference import dense_attention, relative_error
from tests.tp_worker import run_rank

pytestmark = pytest.mark.unit

NUM_HEADS = 8


def run_gang(tmp_path: Path, world_size: int, weights: dict, x: torch.Tensor) -> list[dict]:
    torch.save(weights, tmp_path / "weights.pt")
    torch.save(x, tmp_path / "x.pt")
    torch.save(tuple(x.shape), tmp_path / "x_shape.pt")
    mp.start_processes(
        run_rank, args=(world_size, str(tmp_path), NUM_HEADS), nprocs=world_size, start_method="spawn"
    )
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("init", ["seed", "random"])
def test_tp_attention_matches_dense(tmp_path: Path, world_size: int, init: str) -> None:
    embed_dim = 512
    weights = seed_weights(embed_dim) if init == "seed" else random_weights(embed_dim, seed=7)
    x = torch.randn(4, 16, embed_dim, generator=torch.Generator().manual_seed(1))
    results = run_gang(tmp_path, world_size, weights, x)
    want = dense_attention(weights, NUM_HEADS, x)
    for rank, res in enumerate(results):
        err = relative_error(res["out"], want)
        assert err < 1e-5, f"rank {rank} of {world_size} ({init}): relative error {err:.3e}"
        # ColumnParallelLinear(gather_output=True) must equal the dense projection.
        dense_q = x @ weights["q_proj.weight"].T + weights["q_proj.bias"]
        assert relative_error(res["gathered"], dense_q) < 1e-6
        # Each rank holds 1/world_size of the projection weights (+ the replicated out bias).
        e = embed_dim
        expected_params = 4 * e * e // world_size + 3 * e // world_size + e
        assert res["param_bytes"] == expected_params * 4


def test_notes_example_mean_is_world_size_invariant(tmp_path: Path) -> None:
    """The notes' request: manual_seed(42); randn(128, 8, 512); print(out.mean())."""
    torch.manual_seed(42)
    x = torch.randn(128, 8, 512)
    weights = seed_weights(512)
    want = dense_attention(weights, NUM_HEADS, x)
    means = {}
    for world_size in (1, 2, 4):
        sub = tmp_path / f"ws{world_size}"
        sub.mkdir()
        out = run_gang(sub, world_size, weights, x)[0]["out"]
        assert relative_error(out, want) < 1e-5
        means[world_size] = out.double().mean().item()
    ref = want.double().mean().item()
    for world_size, mean in means.items():
        assert math.isclose(mean, ref, rel_tol=1e-6), f"world_size {world_size}: mean {mean} vs {ref}"
