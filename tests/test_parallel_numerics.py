"""Tensor-parallel attention vs an independent dense reference, real gloo groups (no Ray).

Every gang run of this module is a case (its weights, input, mask, causal flag, dtype), and one
spawned gang per world size runs all of that size's cases in turn (tests/tp_worker.py), on
first use: a process start with torch costs seconds here, and there are ~30 cases."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import pytest
import torch
import torch.multiprocessing as mp

from service.parallel.weights import random_weights, seed_weights
from tests.reference import dense_attention, dense_attention_masked, relative_error
from tests.tp_worker import run_rank

pytestmark = pytest.mark.unit

NUM_HEADS = 8


class Case(NamedTuple):
    weights: dict
    x: torch.Tensor
    mask: torch.Tensor | None = None  # [batch, seq] bool, True = token
    causal: bool = False
    dtype: str | None = None  # compute dtype (default float32)


def _padding_mask(lengths: list[int], seq: int, *, left: bool = False) -> torch.Tensor:
    """[batch, seq] bool, True = token: each row's first (or, left-padded, last) `length` positions."""
    mask = torch.zeros(len(lengths), seq, dtype=torch.bool)
    for row, length in enumerate(lengths):
        if left:
            mask[row, seq - length:] = True
        else:
            mask[row, :length] = True
    return mask


def dense_case(init: str) -> Case:
    weights = seed_weights(512) if init == "seed" else random_weights(512, seed=7)
    return Case(weights, torch.randn(4, 16, 512, generator=torch.Generator().manual_seed(1)))


def notes_case() -> Case:
    """The notes' request: manual_seed(42); randn(128, 8, 512)."""
    torch.manual_seed(42)
    return Case(seed_weights(512), torch.randn(128, 8, 512))


MASKED_CASES = ["mask", "causal", "mask+causal", "left-pad+causal", "holes"]


def masked_case(case: str) -> Case:
    seq = 12
    weights = random_weights(512, seed=11)
    x = torch.randn(4, seq, 512, generator=torch.Generator().manual_seed(2))
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
    return Case(weights, x, mask, "causal" in case)


def bf16_case(masked: bool) -> Case:
    seq = 16
    weights = random_weights(512, seed=3)
    x = torch.randn(4, seq, 512, generator=torch.Generator().manual_seed(8))
    mask = None
    if masked:
        mask = torch.ones(4, seq, dtype=torch.bool)
        mask[1, 9:] = False
        mask[3, 2:] = False
    return Case(weights, x, mask, masked, "bfloat16")


# name -> (the case, the world sizes it runs at)
CASES: dict[str, tuple[Callable[[], Case], tuple[int, ...]]] = {
    **{f"dense-{init}": (lambda init=init: dense_case(init), (1, 2, 4)) for init in ("seed", "random")},
    "notes": (notes_case, (1, 2, 4)),
    **{f"masked-{c}": (lambda c=c: masked_case(c), (1, 2, 4)) for c in MASKED_CASES},
    **{f"bf16-{m}": (lambda m=m: bf16_case(m), (1, 2)) for m in (False, True)},
}


def run_gang(work: Path, world_size: int, cases: dict[str, Case]) -> dict[str, list[dict]]:
    """One gang of `world_size` spawned processes runs every case; case name -> each rank's outputs."""
    for name, case in cases.items():
        sub = work / name
        sub.mkdir()
        torch.save(case.weights, sub / "weights.pt")
        torch.save(case.x, sub / "x.pt")
        torch.save(tuple(case.x.shape), sub / "x_shape.pt")
        if case.mask is not None:
            torch.save(case.mask, sub / "mask.pt")
        if case.causal:
            (sub / "causal").touch()
        if case.dtype:
            (sub / "dtype").write_text(case.dtype)
    (work / "cases").write_text("\n".join(cases))
    mp.start_processes(run_rank, args=(world_size, str(work), NUM_HEADS), nprocs=world_size, start_method="spawn")
    return {name: [torch.load(work / name / f"rank{r}.pt") for r in range(world_size)] for name in cases}


@pytest.fixture(scope="module")
def gang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[int, str], tuple[Case, list[dict]]]]:
    """(world size, case name) -> (the case, each rank's outputs); each world size's gang runs once."""
    runs: dict[int, dict[str, list[dict]]] = {}

    def get(world_size: int, name: str) -> tuple[Case, list[dict]]:
        if world_size not in runs:
            cases = {n: make() for n, (make, sizes) in CASES.items() if world_size in sizes}
            runs[world_size] = run_gang(tmp_path_factory.mktemp(f"gang-ws{world_size}"), world_size, cases)
        return CASES[name][0](), runs[world_size][name]

    yield get


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("init", ["seed", "random"])
def test_tp_attention_matches_dense(gang: Callable, world_size: int, init: str) -> None:
    embed_dim = 512
    (weights, x, *_), results = gang(world_size, f"dense-{init}")
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


def test_notes_example_mean_is_world_size_invariant(gang: Callable) -> None:
    """The notes' request: manual_seed(42); randn(128, 8, 512); print(out.mean())."""
    weights, x, *_ = notes_case()
    want = dense_attention(weights, NUM_HEADS, x)
    means = {}
    for world_size in (1, 2, 4):
        out = gang(world_size, "notes")[1][0]["out"]
        assert relative_error(out, want) < 1e-5
        means[world_size] = out.double().mean().item()
    ref = want.double().mean().item()
    for world_size, mean in means.items():
        assert math.isclose(mean, ref, rel_tol=1e-6), f"world_size {world_size}: mean {mean} vs {ref}"


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", MASKED_CASES)
def test_tp_attention_masked_matches_dense(gang: Callable, world_size: int, case: str) -> None:
    """Key padding mask and causal, alone and combined, vs nn.MultiheadAttention(key_padding_mask,
    attn_mask) with padded rows zeroed, at float32 relative error <= 1e-5."""
    (weights, x, mask, causal, _), results = gang(world_size, f"masked-{case}")
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
def test_bfloat16_compute_within_documented_tolerance(gang: Callable, world_size: int, masked: bool) -> None:
    """compute_dtype=bfloat16: weights, activations and the gloo collectives (broadcast,
    all_reduce) in bfloat16, against the float64 dense reference."""
    embed_dim = 512
    (weights, x, mask, _, _), results = gang(world_size, f"bf16-{masked}")
    dense64 = {k: v.double() for k, v in weights.items()}
    want = dense_attention_masked(dense64, NUM_HEADS, x.double(), None if mask is None else mask.int(), masked)
    for rank, res in enumerate(results):
        assert res["out"].dtype == torch.bfloat16
        err = relative_error(res["out"], want)
        assert err < BF16_TOLERANCE, f"rank {rank} of {world_size}: bfloat16 relative error {err:.3e}"
        assert err > 1e-4, "suspiciously exact: was it computed in bfloat16 at all?"
        assert res["param_bytes"] == (4 * embed_dim**2 // world_size + 3 * embed_dim // world_size + embed_dim) * 2
