"""The model seam (service.parallel.model): the transformer stack and a user's module, tensor-parallel.

References are torch's own modules holding the same weights in float64: `nn.TransformerEncoder`
of `nn.TransformerEncoderLayer` (masks built here, torch's conventions: `src_key_padding_mask`
True = padding, a causal mask True above the diagonal), and the
example's dense `GatedMLP`. Parity runs in real gloo gangs of 1, 2 and 4 spawned processes
(one spawn per world size runs every case); the served tests go through Serve and HTTP.
"""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch import nn

from examples.gated_mlp import GatedMLPDef
from service.parallel.kv_cache import AppendPlan
from service.parallel.model import (check_checkpoint, kv_bytes_per_token, kv_heads_per_rank, load_checkpoint_shard,
                                    new_kv_pool, shard_dense)
from service.parallel.paged_kernel import InPlaceAttention
from service.parallel.transformer import TransformerDef
from tests.conftest import deploy, undeploy
from tests.helpers import assert_error, spawned_gloo_group
from tests.reference import STACKS, TOL, relative_error, torch_encoder, torch_reference

# -- parity in real gangs ------------------------------------------------------------------
def _cases() -> dict[str, dict[str, Any]]:
    """Each case: the architecture, its dense weights, the input, key mask and causal flag.
    Masks pad on the right when causal (torch's own causal + left-padded row is NaN)."""
    gen = torch.Generator().manual_seed(11)
    cases: dict[str, dict[str, Any]] = {}
    right = torch.ones(3, 9, dtype=torch.bool)
    right[1, 6:] = False
    right[2, 4:] = False
    left = torch.ones(3, 9, dtype=torch.bool)
    left[1, :2] = False
    left[2, :5] = False
    for name, arch in STACKS.items():
        weights = arch.init_weights("random", 5)
        for variant, (tokens, causal) in {"plain": (None, False), "causal": (None, True),
                                          "masked": (left, False), "masked-causal": (right, True)}.items():
            x = torch.randn(3, 9, arch.embed_dim, generator=gen)
            cases[f"{name}-{variant}"] = {"arch": arch, "weights": weights, "x": x, "tokens": tokens,
                                          "causal": causal}
    return cases


def _session_steps() -> list[tuple[int, int, tuple[int, ...]]]:
    """Five append steps of one session: (new rows, cached before, block table), blocks of 4.
    The one-row appends take the in-place kernel where the pool has one (the second crosses
    into a block of its own, the last fills it); 18 and 3 rows gather."""
    table = (3, 0, 5, 1, 6, 2)
    return [(18, 0, table[:5]), (1, 18, table[:5]), (3, 19, table), (1, 22, table), (1, 23, table)]


def run_rank(rank: int, world_size: int, workdir: str) -> None:
    """One rank of a spawned gloo gang: every case's forward, then a session of three appends
    on the first stack, through the seam's own objects (build, load_checkpoint_shard, append)."""
    work = Path(workdir)
    with spawned_gloo_group(rank, world_size, work) as group:
        cases = pickle.loads((work / "cases.pkl").read_bytes())
        out: dict[str, torch.Tensor] = {}
        for name, case in cases.items():
            arch = case["arch"]
            model = arch.build(group, torch.float32)
            model.load_shard(load_checkpoint_shard(arch, work / f"{arch.num_layers}-{arch.activation}.safetensors",
                                                   rank, world_size))
            with torch.inference_mode():
                out[name] = model(case["x"], case["tokens"], case["causal"])
        arch = STACKS["post-relu"]
        model = arch.build(group, torch.float32)
        model.load_shard(shard_dense(arch, arch.init_weights("random", 5), rank, world_size))
        rows = pickle.loads((work / "session.pkl").read_bytes())
        plans = [AppendPlan(8, 4, (n,), (c,), (table,)) for n, c, table in _session_steps()]

        def session(pool: Any) -> torch.Tensor:
            """The plans' appends of `rows` through `pool`, their outputs concatenated."""
            with torch.inference_mode():
                appended, at = [], 0
                for plan in plans:
                    appended.append(model.append(rows[at:at + plan.rows], plan, pool))
                    at += plan.rows
            return torch.cat(appended)

        pool = new_kv_pool(arch, world_size, plans[0], torch.float32, torch.device("cpu"))
        out["session"] = session(pool)
        out["pool_bytes"] = torch.tensor(pool.nbytes)
        # The same appends with the one-row appends read from the pool in place (the C++ kernel).
        pool = new_kv_pool(arch, world_size, plans[0], torch.float32, torch.device("cpu"))
        kv = kv_heads_per_rank(arch, world_size)
        pool.attention = InPlaceAttention(8, 4, kv, kv, arch.head_dim, torch.float32)
        out["session-in-place"] = session(pool)
        torch.save(out, work / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def gang_outputs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict[str, torch.Tensor]]]:
    """world size -> each rank's outputs (one spawned gang per world size, run on first use)."""
    cases = _cases()
    runs: dict[int, list[dict[str, torch.Tensor]]] = {}

    def get(world_size: int) -> list[dict[str, torch.Tensor]]:
        if world_size not in runs:
            work = tmp_path_factory.mktemp(f"models-ws{world_size}")
            for arch in STACKS.values():  # checkpoints in torch's own state_dict format
                save_file({k: v.contiguous() for k, v in torch_encoder(arch, arch.init_weights("random", 5))
                           .float().state_dict().items()}, str(work / f"{arch.num_layers}-{arch.activation}.safetensors"))
            (work / "cases.pkl").write_bytes(pickle.dumps(cases))
            session = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
            (work / "session.pkl").write_bytes(pickle.dumps(session))
            mp.start_processes(run_rank, args=(world_size, str(work)), nprocs=world_size, start_method="spawn")
            runs[world_size] = [torch.load(work / f"rank{r}.pt") for r in range(world_size)]
        return runs[world_size]

    return get



@pytest.mark.unit
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_transformer_stack_matches_torch_encoder_at_every_world_size(gang_outputs: Callable, world_size: int) -> None:
    """Plain, causal, masked (left padding) and masked + causal, pre- and post-norm, relu and gelu:
    every rank returns torch's output at token rows, and 0 at padded rows."""
    ranks = gang_outputs(world_size)
    for name, case in _cases().items():
        want = torch_reference(torch_encoder(case["arch"], case["weights"]), case["x"], case["tokens"], case["causal"])
        tokens = case["tokens"] if case["tokens"] is not None else torch.ones(want.shape[:2], dtype=torch.bool)
        for rank, out in enumerate(ranks):
            got = out[name]
            assert relative_error(got[tokens], want[tokens]) <= TOL, (name, rank)
            assert torch.count_nonzero(got[~tokens]) == 0, (name, rank)


@pytest.mark.unit
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_session_appends_equal_the_causal_stack_over_the_whole_sequence(gang_outputs: Callable,
                                                                         world_size: int) -> None:
    """A prefill of 18, one row, 3 rows, then one row twice: each append's outputs are torch's
    causal stack's rows at those positions over the whole sequence (every layer reads its own
    cached K/V), gathered and with the one-row appends read in place, at every world size."""
    arch = STACKS["post-relu"]
    rows = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    want = torch_reference(torch_encoder(arch, arch.init_weights("random", 5)), rows[None], None, True)[0]
    for out in gang_outputs(world_size):
        assert relative_error(out["session"], want) <= TOL
        assert relative_error(out["session-in-place"], want) <= TOL  # the pool read in place
        assert relative_error(out["session-in-place"], out["session"]) <= 1e-6  # = the gather path
        # the pool: 2 (K, V) x 3 layers x E/p x 4 bytes a token, 8 blocks of 4 tokens
        assert int(out["pool_bytes"]) == 8 * 4 * kv_bytes_per_token(arch, world_size, 4) == 8 * 4 * 2 * 3 * 64 // world_size * 4


@pytest.mark.unit
def test_checkpoint_that_does_not_fit_is_refused_naming_each_difference(tmp_path: Path) -> None:
    arch = STACKS["post-relu"]
    state = torch_encoder(arch, arch.init_weights("random", 1)).float().state_dict()
    path = tmp_path / "ok.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    check_checkpoint(arch, path)  # torch's own state_dict fits as it is
    del state["layers.2.norm2.bias"]
    state["layers.0.linear1.weight"] = torch.zeros(32, 64)
    state["layers.0.extra"] = torch.zeros(1)
    bad = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(bad))
    with pytest.raises(ValueError) as err:
        check_checkpoint(arch, bad)
    text = str(err.value)
    assert "missing 'layers.2.norm2.bias' [64]" in text
    assert "layers.0.linear1.weight has shape [32, 64], the model needs [96, 64]" in text
    assert "unexpected 'layers.0.extra'" in text


@pytest.mark.unit
def test_a_rank_reads_only_its_slices_of_the_fused_qkv() -> None:
    """in_proj_weight [3E, E] = [W_q; W_k; W_v]: rank r of p holds rows r*E/p.. of each block."""
    arch = STACKS["pre-gelu"]
    w = arch.init_weights("random", 0)
    shard = shard_dense(arch, w, 1, 2)["layers.0.self_attn.in_proj_weight"]
    dense = w["layers.0.self_attn.in_proj_weight"]
    assert torch.equal(shard, torch.cat([dense[32:64], dense[96:128], dense[160:192]]))


@pytest.mark.unit
def test_init_is_reproducible_and_independent_of_world_size() -> None:
    """What each rank of a gang of 1, 2 or 4 loads from init=random (service.gang.worker's
    load_rank_shard, as a rank does at bring-up) is a piece of ONE set of dense weights: a
    tensor a rank holds whole is the world-size-1 tensor, and a tensor split over the ranks
    holds, over all ranks, exactly the world-size-1 tensor's values (compared as sorted
    values, so the check does not restate the sharding layout). Loading again gives the same
    weights; another seed gives other values in every tensor."""
    from service.config.builder_args import ModelConfig
    from service.gang.worker import load_rank_shard

    def model(seed: int) -> ModelConfig:
        return ModelConfig(model="transformer", num_layers=2, embed_dim=64, num_heads=8, ffn_dim=96, init="random",
                           seed=seed)

    dense = load_rank_shard(model(4), 0, 1)  # world size 1: the dense weights
    for world_size in (2, 4):
        ranks = [load_rank_shard(model(4), rank, world_size) for rank in range(world_size)]
        assert all(set(shard) == set(dense) for shard in ranks)
        split = 0
        for name, whole in dense.items():
            pieces = [shard[name] for shard in ranks]
            if all(piece.shape == whole.shape for piece in pieces):
                assert all(torch.equal(piece, whole) for piece in pieces), (world_size, name)
                continue
            split += 1
            assert sum(piece.numel() for piece in pieces) == whole.numel(), (world_size, name)
            values = torch.cat([piece.flatten() for piece in pieces]).sort().values
            assert torch.equal(values, whole.flatten().sort().values), (world_size, name)
        assert split >= 4 * 2, f"world size {world_size}: only {split} tensors were split"  # qkv, out, ffn x 2 layers
    again, other = load_rank_shard(model(4), 0, 1), load_rank_shard(model(5), 0, 1)
    assert all(torch.equal(again[k], dense[k]) for k in dense)
    random = [k for k in dense if ".norm" not in k]  # norms start at 1 and 0 for every seed
    assert random and all(not torch.equal(other[k], dense[k]) for k in random)


@pytest.mark.unit
def test_builder_arguments_of_another_model_are_refused() -> None:
    from pydantic import ValidationError

    from service.config.builder_args import AppConfig

    with pytest.raises(ValidationError, match="num_layers, ffn_dim only apply to model=transformer"):
        AppConfig.model_validate({"num_layers": 4, "ffn_dim": 64})
    with pytest.raises(ValidationError, match=r"ffn_dim \(100\) must be divisible by world_size \(8\)"):
        AppConfig.model_validate({"model": "transformer", "world_size": 8, "ffn_dim": 100})
    with pytest.raises(ValidationError, match="model must be one of attention, transformer, llama or an import path"):
        AppConfig.model_validate({"model": "gpt"})
    # A kind's own arguments may come as model_args: the same model as the flat arguments.
    flat = AppConfig.model_validate({"model": "transformer", "num_layers": 3, "embed_dim": 64, "num_heads": 4})
    mapped = AppConfig.model_validate({"model": "transformer",
                                       "model_args": {"num_layers": 3, "embed_dim": 64, "num_heads": 4}})
    assert mapped.model == flat.model
    with pytest.raises(ValidationError, match="num_layers given twice"):
        AppConfig.model_validate({"model": "transformer", "num_layers": 2, "model_args": {"num_layers": 3}})
    with pytest.raises(ValidationError, match="model_args: hidden not its arguments"):
        AppConfig.model_validate({"model": "transformer", "model_args": {"hidden": 3}})


@pytest.mark.unit
def test_a_user_model_that_cannot_be_imported_is_refused_at_deploy_time() -> None:
    from service.app import InvalidAppArgs, build_app

    with pytest.raises(InvalidAppArgs, match="cannot import 'no_such_pkg.mod'"):
        build_app({"model": "no_such_pkg.mod:factory"})
    with pytest.raises(InvalidAppArgs, match=r"gate_up.weight: dim 0 \(198 = 2 block\(s\)\) is not divisible into 2 "
                       r"rank slices per block; .*down.weight: dim 1 \(99\) is not divisible by 2"):
        build_app({"model": "examples.gated_mlp:gated_mlp", "embed_dim": 64, "world_size": 2,
                   "model_args": {"hidden_dim": 99}})


# -- served through Serve and HTTP ---------------------------------------------------------
SERVED = TransformerDef(3, 64, 8, 128, "gelu", True)


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _infer(base: str, x: np.ndarray, *, causal: bool = False, tokens: np.ndarray | None = None) -> np.ndarray:
    if tokens is None:
        r = httpx.post(f"{base}/infer?causal={str(causal).lower()}", content=_npy(x),
                       headers={"content-type": "application/x-npy"}, timeout=60)
    else:
        r = httpx.post(f"{base}/infer?causal={str(causal).lower()}", timeout=60,
                       json={"hidden_states": x.tolist(), "attention_mask": tokens.astype(int).tolist()})
        assert r.status_code == 200, r.text
        return np.asarray(r.json()["output"], dtype=np.float32)
    assert r.status_code == 200, r.text
    return np.load(io.BytesIO(r.content), allow_pickle=False)


@pytest.fixture(scope="module")
def transformer_app(serve_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, nn.Module]]:
    """The issue's example, smaller: a torch module's own state_dict saved with safetensors and
    served at world size 2 (pre-norm, gelu); yields the base URL and torch's float64 module."""
    module = SERVED.dense_module()  # torch's default init: what a user's model would hold
    path = tmp_path_factory.mktemp("encoder") / "encoder.safetensors"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    args = {"world_size": 2, "model": "transformer", "num_layers": SERVED.num_layers, "embed_dim": SERVED.embed_dim,
            "num_heads": SERVED.num_heads, "ffn_dim": SERVED.ffn_dim, "activation": SERVED.activation,
            "norm_first": SERVED.norm_first, "checkpoint": str(path), "cpus_per_rank": 0.25,
            "session_block_tokens": 4}
    base = deploy(serve_url, "models-transformer", "/models-transformer", args)
    yield base, torch_encoder(SERVED, weights)
    undeploy("models-transformer")


@pytest.mark.ray
def test_served_stack_answers_like_torch_masked_causal_and_in_sessions(transformer_app: tuple[str, nn.Module]) -> None:
    base, module = transformer_app
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 64), dtype=np.float32)
    for causal in (False, True):
        want = torch_reference(module, torch.from_numpy(x), None, causal)
        assert relative_error(torch.from_numpy(_infer(base, x, causal=causal)), want) <= TOL, causal
    tokens = np.ones((2, 7), dtype=bool)
    tokens[1, 5:] = False
    got = torch.from_numpy(_infer(base, x, causal=True, tokens=tokens))
    want = torch_reference(module, torch.from_numpy(x), torch.from_numpy(tokens), True)
    t = torch.from_numpy(tokens)
    assert relative_error(got[t], want[t]) <= TOL
    assert torch.count_nonzero(got[~t]) == 0
    # A session: a prefill of 5 rows, then 1, then 3; each answer is the causal stack's rows.
    seq = rng.standard_normal((9, 64), dtype=np.float32)
    want = torch_reference(module, torch.from_numpy(seq)[None], None, True)[0]
    r = httpx.post(f"{base}/sessions", content=_npy(seq[:5]), headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 201, r.text
    sid = r.headers["x-session-id"]
    got = torch.from_numpy(np.load(io.BytesIO(r.content), allow_pickle=False)).reshape(5, 64)
    assert relative_error(got, want[:5]) <= TOL  # the prefill's own rows
    at = 5
    for n in (1, 3):
        r = httpx.post(f"{base}/sessions/{sid}/append", content=_npy(seq[at:at + n]),
                       headers={"content-type": "application/x-npy"}, timeout=60)
        assert r.status_code == 200, r.text
        got = torch.from_numpy(np.load(io.BytesIO(r.content), allow_pickle=False)).reshape(n, 64)
        assert relative_error(got, want[at:at + n]) <= TOL, n
        at += n
    sessions = httpx.get(f"{base}/gang", timeout=10).json()["sessions"]
    assert sessions["bytes_per_token_per_rank"] == 2 * 3 * (64 // 2) * 4  # 2 x layers x E/p x float32


@pytest.mark.ray
def test_a_checkpoint_of_another_architecture_is_refused_naming_the_differences(
        transformer_app: tuple[str, nn.Module]) -> None:
    """POST /weights with a 2-layer file on the 3-layer gang: 409, nothing changes."""
    base, _ = transformer_app
    from tests.conftest import TEST_API_TOKEN

    other = TransformerDef(2, 64, 8, 128, "gelu", True)
    path = Path(os.environ["GANGSERVE_STATE_DIR"]) / "models-two-layers.safetensors"  # POST /weights reads the state dir
    save_file({k: v.contiguous() for k, v in other.dense_module().state_dict().items()}, str(path))
    before = httpx.get(f"{base}/gang", timeout=10).json()["weights_version"]
    r = httpx.post(f"{base}/weights", json={"checkpoint": str(path)}, timeout=60,
                   headers={"authorization": f"Bearer {TEST_API_TOKEN}"})
    assert_error(r, 409, "checkpoint_mismatch")
    assert "missing 'layers.2.self_attn.in_proj_weight' [192, 64]" in r.json()["error"]
    assert httpx.get(f"{base}/gang", timeout=10).json()["weights_version"] == before


@pytest.mark.ray
def test_the_docs_user_model_is_served_tensor_parallel(serve_url: str) -> None:
    """docs/models.md's worked example, named by import path only: no change anywhere else."""
    arch = GatedMLPDef(64, 96)
    base = deploy(serve_url, "models-user", "/models-user",
                  {"world_size": 2, "model": "examples.gated_mlp:gated_mlp", "embed_dim": 64,
                   "model_args": {"hidden_dim": 96}, "init": "random", "seed": 7, "cpus_per_rank": 0.25})
    try:
        dense = arch.dense_module().double()
        dense.load_state_dict({k: v.double() for k, v in arch.init_weights("random", 7).items()}, strict=True)
        x = np.random.default_rng(1).standard_normal((3, 5, 64), dtype=np.float32)
        with torch.no_grad():
            want = dense(torch.from_numpy(x).double())
        assert relative_error(torch.from_numpy(_infer(base, x)), want) <= TOL
    finally:
        undeploy("models-user")
