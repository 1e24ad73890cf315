"""`model=llama` (service.parallel.llama) against Hugging Face's own `LlamaModel`.

The reference is `transformers.LlamaModel` built from a tiny `LlamaConfig` with its random init
(no download), saved with `save_pretrained` and run in float64: `inputs_embeds` in,
`last_hidden_state` out. A padded sequence's reference is its real rows alone (positions 0..n-1),
so left and right padding must both give it. Session appends are compared with `LlamaModel`'s
own incremental decode (`past_key_values`). Parity runs in real gloo gangs of 1, 2 and 4 spawned
processes (one spawn per world size runs every case), through the seam's own objects: the
checkpoint directory read by `open_checkpoint`, each rank reading only its slices.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest
import torch
import torch.multiprocessing as mp

from service.parallel.kv_cache import AppendPlan
from service.parallel.llama import LlamaDef
from service.models.llama import LlamaArchitecture
from service.parallel.model import (
    ParamSpec,
    Shard,
    check_checkpoint,
    kv_bytes_per_token,
    kv_heads_per_rank,
    load_checkpoint_shard,
    new_kv_pool,
    unused_tensors,
)
from service.parallel.paged_kernel import InPlaceAttention
from tests.helpers import spawned_gloo_group
from tests.reference import relative_error

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaModel

pytestmark = pytest.mark.unit


def _hf() -> Any:
    """transformers, imported where the reference is built (this test process): the spawned ranks
    import this module for `run_rank`, and importing transformers costs each ~4 s of CPU."""
    import transformers

    return transformers

TOL = 1e-5  # float32 against float64 (the parity goal)
BF16_TOL = 3e-2  # bfloat16 keeps 8 bits of mantissa: ~4e-3 a rounding, over two blocks and a final norm
WIDTH = 64
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# name -> (num_key_value_heads, rope parameters or None, saved as: "causal-lm" | "model" | "sharded")
STACKS: dict[str, tuple[int, dict[str, Any] | None, str]] = {
    "kv1": (1, None, "model"),  # one K/V head: replicated on every rank
    "kv2-llama3": (2, LLAMA3_ROPE, "causal-lm"),  # fewer K/V heads than ranks at world size 4
    "kv4": (4, None, "sharded"),  # K/V heads = heads (no grouping), a sharded index
}


def llama_config(kv_heads: int, rope: dict[str, Any] | None) -> LlamaConfig:
    extra = {"rope_parameters": rope} if rope else {}
    return _hf().LlamaConfig(hidden_size=WIDTH, num_attention_heads=4, num_key_value_heads=kv_heads,
                             intermediate_size=96, num_hidden_layers=2, vocab_size=32, max_position_embeddings=64,
                             rms_norm_eps=1e-5, **extra)


def save_stack(name: str, directory: Path) -> LlamaModel:
    """A random-init stack saved as the case says; returns Hugging Face's float64 LlamaModel of it."""
    kv, rope, layout = STACKS[name]
    torch.manual_seed(len(name))
    config = llama_config(kv, rope)
    if layout == "causal-lm":  # names under `model.`, plus embed_tokens and lm_head the service ignores
        full = _hf().LlamaForCausalLM(config)
        full.save_pretrained(directory)
        stack = full.model
    else:
        stack = _hf().LlamaModel(config)
        stack.save_pretrained(directory, max_shard_size="20KB" if layout == "sharded" else "5GB")
    reference = _hf().LlamaModel(config).double().eval()
    reference.load_state_dict({k: v.double() for k, v in stack.state_dict().items()}, strict=True)
    return reference


def hf_output(model: LlamaModel, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    """float64 LlamaModel output; a padded sequence's real rows computed alone, padded rows 0."""
    with torch.no_grad():
        if tokens is None:
            return model(inputs_embeds=x.double()).last_hidden_state
        out = torch.zeros(x.shape, dtype=torch.float64)
        for b in range(x.shape[0]):
            real = tokens[b]
            out[b, real] = model(inputs_embeds=x[b, real][None].double()).last_hidden_state[0]
        return out


def _inputs() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, WIDTH, generator=gen)
    left = torch.ones(3, 7, dtype=torch.bool)
    left[1, :3] = False
    left[2, :1] = False
    right = torch.ones(3, 7, dtype=torch.bool)
    right[1, 4:] = False
    right[2, 6:] = False
    return {"plain": (x, None), "left": (x, left), "right": (x, right)}


def _same_rows_padded_left_and_right() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One 4-row sequence, left-padded in one batch and right-padded in another."""
    rows = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(9))
    lx, rx = torch.zeros(1, 7, WIDTH), torch.zeros(1, 7, WIDTH)
    lx[0, 3:], rx[0, :4] = rows, rows
    lm, rm = torch.zeros(1, 7, dtype=torch.bool), torch.zeros(1, 7, dtype=torch.bool)
    lm[0, 3:], rm[0, :4] = True, True
    return lx, lm, rx, rm


# (new rows, cached, block table), blocks of 4: the one-row appends take the in-place kernel where
# the pool has one (the second crosses into a block of its own, the last fills it); 18 and 3 rows gather
SESSION_STEPS = [(18, 0, (3, 0, 5, 1, 6)), (1, 18, (3, 0, 5, 1, 6)), (3, 19, (3, 0, 5, 1, 6, 2)),
                 (1, 22, (3, 0, 5, 1, 6, 2)), (1, 23, (3, 0, 5, 1, 6, 2))]


def run_rank(rank: int, world_size: int, workdir: str) -> None:
    """One rank of a spawned gloo gang: every stack's forwards (float32 and bfloat16), the
    left/right-padded pair, and a session of three appends, through the seam's objects."""
    work = Path(workdir)
    with spawned_gloo_group(rank, world_size, work) as group:
        inputs = pickle.loads((work / "inputs.pkl").read_bytes())
        out: dict[str, Any] = {}
        for name in STACKS:
            directory = work / name
            arch = LlamaDef.from_directory(directory)
            check_checkpoint(arch, directory)
            for dtype in (torch.float32, torch.bfloat16):
                model = arch.build(group, dtype)
                shard = load_checkpoint_shard(arch, directory, rank, world_size, dtype)
                out[f"{name}-shard-dtypes-{dtype}"] = sorted({str(t.dtype) for t in shard.values()})
                model.load_shard(shard)
                with torch.inference_mode():
                    for case, (x, tokens) in inputs["cases"].items():
                        out[f"{name}-{case}-{dtype}"] = model(x.to(dtype), tokens).float()
                    if dtype == torch.float32:
                        lx, lm, rx, rm = inputs["pair"]
                        out[f"{name}-pair"] = (model(lx, lm), model(rx, rm))
                        plans = [AppendPlan(8, 4, (n,), (c,), (table,)) for n, c, table in SESSION_STEPS]
                        pool = new_kv_pool(arch, world_size, plans[0], dtype, torch.device("cpu"))
                        appended, at = [], 0
                        for plan in plans:
                            appended.append(model.append(inputs["session"][at:at + plan.rows], plan, pool))
                            at += plan.rows
                        out[f"{name}-session"] = torch.cat(appended)
                        out[f"{name}-pool-bytes"] = pool.nbytes
                        out[f"{name}-param-bytes"] = model.parameter_bytes()
                        # again with the one-row appends read in place (grouped-query included)
                        pool = new_kv_pool(arch, world_size, plans[0], dtype, torch.device("cpu"))
                        pool.attention = InPlaceAttention(8, 4, arch.arch.num_heads // world_size,
                                                          kv_heads_per_rank(arch, world_size), arch.head_dim, dtype)
                        appended, at = [], 0
                        for plan in plans:
                            appended.append(model.append(inputs["session"][at:at + plan.rows], plan, pool))
                            at += plan.rows
                        out[f"{name}-session-in-place"] = torch.cat(appended)
        torch.save(out, work / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, LlamaModel]]:
    root = tmp_path_factory.mktemp("llama-stacks")
    return root, {name: save_stack(name, root / name) for name in STACKS}


@pytest.fixture(scope="module")
def gang_outputs(stacks: tuple[Path, dict[str, LlamaModel]],
                 tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict[str, Any]]]:
    """world size -> each rank's outputs (one spawned gang per world size, run on first use)."""
    root, _ = stacks
    runs: dict[int, list[dict[str, Any]]] = {}

    def get(world_size: int) -> list[dict[str, Any]]:
        if world_size not in runs:
            work = tmp_path_factory.mktemp(f"llama-ws{world_size}")
            for name in STACKS:
                (work / name).symlink_to(root / name)
            session = torch.randn(24, WIDTH, generator=torch.Generator().manual_seed(4))
            (work / "inputs.pkl").write_bytes(pickle.dumps(
                {"cases": _inputs(), "pair": _same_rows_padded_left_and_right(), "session": session}))
            mp.start_processes(run_rank, args=(world_size, str(work)), nprocs=world_size, start_method="spawn")
            runs[world_size] = [torch.load(work / f"rank{r}.pt") for r in range(world_size)]
        return runs[world_size]

    return get


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_rank_answers_like_hugging_face_llama_model(stacks: tuple[Path, dict[str, LlamaModel]],
                                                          gang_outputs: Callable, world_size: int) -> None:
    """K/V heads 1, 2 and 4 of 4 (replicated, grouped, plain), default and llama3 rope, no
    padding and padding on either side: float32 within 1e-5 of float64, bfloat16 within its
    tolerance, padded rows 0."""
    _, models = stacks
    ranks = gang_outputs(world_size)
    for name, model in models.items():
        for case, (x, tokens) in _inputs().items():
            want = hf_output(model, x, tokens)
            real = tokens if tokens is not None else torch.ones(x.shape[:2], dtype=torch.bool)
            for rank, out in enumerate(ranks):
                got = out[f"{name}-{case}-{torch.float32}"]
                assert relative_error(got[real], want[real]) <= TOL, (name, case, rank)
                assert torch.count_nonzero(got[~real]) == 0, (name, case, rank)
                bf16 = out[f"{name}-{case}-{torch.bfloat16}"]
                assert relative_error(bf16[real], want[real]) <= BF16_TOL, (name, case, rank)


@pytest.mark.parametrize("world_size", [1, 4])
def test_left_and_right_padding_give_the_same_real_rows(gang_outputs: Callable, world_size: int) -> None:
    for out in gang_outputs(world_size):
        for name in STACKS:
            left, right = out[f"{name}-pair"]
            assert relative_error(left[0, 3:], right[0, :4]) <= TOL, name


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_session_appends_equal_hugging_face_incremental_decode(stacks: tuple[Path, dict[str, LlamaModel]],
                                                               gang_outputs: Callable, world_size: int) -> None:
    """A prefill of 18, one row, 3 rows, then one row twice: each append's outputs equal
    LlamaModel run on the same rows with its own past_key_values (positions continue from the
    session's length), gathered and with the one-row appends read in place, at every world size."""
    _, models = stacks
    rows = torch.randn(24, WIDTH, generator=torch.Generator().manual_seed(4)).double()
    for name, model in models.items():
        cache, want, at = _hf().DynamicCache(config=model.config), [], 0
        with torch.no_grad():
            for n, _, _ in SESSION_STEPS:
                step = model(inputs_embeds=rows[at:at + n][None], past_key_values=cache, use_cache=True)
                cache, at = step.past_key_values, at + n
                want.append(step.last_hidden_state[0])
        want_all = torch.cat(want)
        kv_heads = STACKS[name][0]
        for out in gang_outputs(world_size):
            assert relative_error(out[f"{name}-session"], want_all) <= TOL, name
            assert relative_error(out[f"{name}-session-in-place"], want_all) <= TOL, name  # the pool in place
            assert relative_error(out[f"{name}-session-in-place"], out[f"{name}-session"]) <= 1e-6, name
            # the pool caches this rank's own K/V heads: kv/p, or one when K/V heads are replicated
            per_rank = max(kv_heads // world_size, 1)
            arch = LlamaDef.from_directory(stacks[0] / name)
            assert out[f"{name}-pool-bytes"] == 8 * 4 * kv_bytes_per_token(arch, world_size, 4) \
                == 8 * 4 * 2 * 2 * per_rank * 16 * 4


def test_a_bf16_checkpoint_is_read_into_bf16_and_float32_only_when_asked(gang_outputs: Callable) -> None:
    """A float32 checkpoint read for a bfloat16 gang: the rank's slices are bf16 (no float32 copy)."""
    out = gang_outputs(2)[0]
    assert out[f"kv4-shard-dtypes-{torch.bfloat16}"] == ["torch.bfloat16"]
    assert out[f"kv4-shard-dtypes-{torch.float32}"] == ["torch.float32"]


def test_parameter_bytes_shrink_with_the_world_size(gang_outputs: Callable) -> None:
    """Each rank holds 1/p of the projections and the MLP; the norms and replicated K/V heads are whole."""
    one, four = gang_outputs(1)[0]["kv4-param-bytes"], gang_outputs(4)[0]["kv4-param-bytes"]
    norms = (2 * 2 + 1) * WIDTH * 4
    assert four - norms == (one - norms) // 4


def test_checkpoint_directory_names_and_ignored_tensors(stacks: tuple[Path, dict[str, LlamaModel]]) -> None:
    """LlamaForCausalLM's `model.` prefix is dropped; embed_tokens and lm_head are named unused."""
    root, _ = stacks
    assert unused_tensors(LlamaDef.from_directory(root / "kv2-llama3"), root / "kv2-llama3") == \
        ["embed_tokens.weight", "lm_head.weight"]
    assert unused_tensors(LlamaDef.from_directory(root / "kv1"), root / "kv1") == ["embed_tokens.weight"]
    assert (root / "kv4" / "model.safetensors.index.json").is_file()  # the sharded layout is exercised


def test_a_directory_of_another_architecture_is_refused_naming_the_difference(
        stacks: tuple[Path, dict[str, LlamaModel]], tmp_path: Path) -> None:
    root, _ = stacks
    config = json.loads((root / "kv4" / "config.json").read_text())
    for f in (root / "kv4").iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight has shape \[96, 64\], the model needs \[128, 64\]"):
        check_checkpoint(LlamaDef.from_directory(tmp_path), tmp_path)


@pytest.mark.parametrize(("heads", "kv", "world_size", "message"), [
    (4, 3, 2, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    (6, 6, 4, "num_attention_heads (6) must be divisible by world_size (4)"),
    (12, 6, 4, "num_key_value_heads (6) and world_size (4): one must divide the other"),
])
def test_a_split_that_does_not_exist_is_refused_naming_the_numbers(heads: int, kv: int, world_size: int,
                                                                   message: str) -> None:
    config = _hf().LlamaConfig(hidden_size=12 * 8, num_attention_heads=heads, num_key_value_heads=kv,
                         intermediate_size=96, num_hidden_layers=1, head_dim=8)
    with pytest.raises(ValueError, match=f"world_size {world_size}: .*{message}".replace("(", r"\(").replace(")", r"\)")):
        LlamaDef(LlamaArchitecture.from_hf_config(config.to_dict())).check_world_size(world_size)


def test_replicated_kv_heads_take_the_rank_s_own_head() -> None:
    """A K/V projection of 2 heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1."""
    dense = torch.arange(2 * 3 * 5).reshape(6, 5)  # 2 heads of 3 rows
    spec = ParamSpec("k_proj.weight", (6, 5), Shard.COLUMN, groups=2)
    assert [spec.take(dense, r, 4).tolist() for r in range(4)] == \
        [dense[:3].tolist(), dense[:3].tolist(), dense[3:].tolist(), dense[3:].tolist()]
    assert torch.equal(spec.take(dense, 1, 2), dense[3:])
    assert spec.check_divides(3) is not None and spec.check_divides(4) is None
