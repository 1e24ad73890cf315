"""Tensor-parallel attention vs an independent dense reference, real gloo groups (no Ray)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from service.parallel.weights import random_weights, seed_weights
from tests.reference import dense_attention, dense_attention_masked, relative_error
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


def _padding_mask(lengths: list[int], seq: int, *, left: bool = False) -> torch.Tensor:
    """[batch, seq] bool, True = token: each row's first (or, left-padded, last) `length` positions."""
    mask = torch.zeros(len(lengths), seq, dtype=torch.bool)
    for row, length in enumerate(lengths):
        if left:
            mask[row, seq - length:] = True
        else:
            mask[row, :length] = True
    return mask


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", ["mask", "causal", "mask+causal", "left-pad+causal", "holes"])
def test_tp_attention_masked_matches_dense(tmp_path: Path, world_size: int, case: str) -> None:
    """Key padding mask and causal, alone and combined, vs nn.MultiheadAttention(key_padding_mask,
    attn_mask) with padded rows zeroed, at float32 relative error <= 1e-5."""
    embed_dim, seq = 512, 12
    weights = random_weights(embed_dim, seed=11)
    x = torch.randn(4, seq, embed_dim, generator=torch.Generator().manual_seed(2))
    causal = "causal" in case
    mask: torch.Tensor | None
    if case in ("mask", "mask+causal"):
        mask = _padding_mask([12, 7, 1, 3], seq)
    elif case == "left-pad+causal":
        mask = _padding_mask([12, 5, 1, 9], seq, left=True)  # padded query 0 would have no key at all
    elif case == "holes":
        mask = torch.rand(4, seq, generator=torch.Generator().manual_seed(3)) > 0.4
        mask[:, 0] = True  # no row all padding
    else:
        mask = None
    if mask is not None:
        torch.save(mask, tmp_path / "mask.pt")
    if causal:
        (tmp_path / "causal").touch()
    results = run_gang(tmp_path, world_size, weights, x)
    want = dense_attention_masked(weights, NUM_HEADS, x, None if mask is None else mask.int(), causal)
    assert torch.isfinite(want).all()
    for rank, res in enumerate(results):
        out = res["out"]
        assert torch.isfinite(out).all(), f"rank {rank}: non-finite output"
        err = relative_error(out, want)
        assert err < 1e-5, f"rank {rank} of {world_size} ({case}): relative error {err:.3e}"
        if mask is not None:
            assert (out[~mask] == 0).all(), "padded query positions must be exactly 0"


def test_masked_path_equals_unmasked_when_all_tokens() -> None:
    """An all-ones mask computes the same function as no mask (single rank, in process)."""
    from service.parallel import ParallelGroup, TensorParallelAttention
    from service.parallel.weights import shard_dense

    weights = random_weights(64, seed=5)
    model = TensorParallelAttention(64, 4, ParallelGroup.single())
    model.load_shard(shard_dense(weights, 0, 1))
    x = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(4))
    ones = torch.ones(3, 9, dtype=torch.bool)
    with torch.inference_mode():
        for causal in (False, True):
            assert relative_error(model(x, ones, causal), model(x, None, causal)) < 1e-6
            want = dense_attention_masked(weights, 4, x, None, causal)
            assert relative_error(model(x, None, causal), want) < 1e-5


# Measured (issue 22), random init U(+-1/sqrt(E)), E=512, H=8, x ~ N(0, 1): bfloat16 relative
# error against the float64 reference 4.1e-3 .. 4.7e-3 (bfloat16 keeps 8 significant bits:
# unit roundoff 3.9e-3); float32 3.5e-7. The documented bound is 1e-2.
BF16_TOLERANCE = 1e-2


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask+causal"])
def test_bfloat16_compute_within_documented_tolerance(tmp_path: Path, world_size: int, masked: bool) -> None:
    """compute_dtype=bfloat16: weights, activations and the gloo collectives (broadcast,
    all_reduce) in bfloat16, against the float64 dense reference."""
    embed_dim, seq = 512, 16
    weights = random_weights(embed_dim, seed=3)
    x = torch.randn(4, seq, embed_dim, generator=torch.Generator().manual_seed(8))
    mask = None
    if masked:
        mask = torch.ones(4, seq, dtype=torch.bool)
        mask[1, 9:] = False
        mask[3, 2:] = False
        torch.save(mask, tmp_path / "mask.pt")
        (tmp_path / "causal").touch()
    (tmp_path / "dtype").write_text("bfloat16")
    results = run_gang(tmp_path, world_size, weights, x)
    dense64 = {k: v.double() for k, v in weights.items()}
    want = dense_attention_masked(dense64, NUM_HEADS, x.double(), None if mask is None else mask.int(), masked)
    for rank, res in enumerate(results):
        assert res["out"].dtype == torch.bfloat16
        err = relative_error(res["out"], want)
        assert err < BF16_TOLERANCE, f"rank {rank} of {world_size}: bfloat16 relative error {err:.3e}"
        assert err > 1e-4, "suspiciously exact: was it computed in bfloat16 at all?"
        assert res["param_bytes"] == (4 * embed_dim**2 // world_size + 3 * embed_dim // world_size + embed_dim) * 2
