"""The model seam: what the gang, the sessions, the weights code and training ask of a model.

A model is two objects:

- a `ModelDef`: the architecture, declared once. It names every dense parameter (the names
  and shapes of its reference torch module's `state_dict()`, which is also its checkpoint
  format), how each one is sharded over the gang, how `init` makes dense weights, and it
  builds the dense reference module (the training model) and a rank's local module.
- a `RankModel` (what `ModelDef.build` returns): rank r's shard as an `nn.Module`, with the
  rank-local forward of a step and the rank-local append of a session step.

The gang, the transport, the routes and the batchers know neither: they move tensors of
shape [batch, seq, E] and ask the rank to compute. Adding a model is one module that
implements these two protocols, named in the builder arguments by its import path
(`model=pkg.module:factory`, service.parallel.registry), or a built-in kind in that registry:
tests/test_models.py serves one defined in a test file without a change anywhere else.

Sharding (`Shard`, `ParamSpec`): service.models.params.

Everything here is pure torch (and safetensors for files): no Ray, no pydantic.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from service.models.params import AttentionHeads, ParamSpec, Shard  # noqa: F401 - the seam's names
from service.parallel.group import ParallelGroup
from service.parallel.huge_pages import move_parameters
from service.parallel.kv_cache import AppendPlan, PagedKVPool

DenseWeights = dict[str, torch.Tensor]


@runtime_checkable
class RankModel(Protocol):
    """Rank r's shard of a model (an `nn.Module`), built by `ModelDef.build`.

    Every method runs on every rank of the gang in the same order (the gang's sequencer), with
    identical inputs; a method that issues collectives issues the same ones on every rank.
    """

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        """x [batch, seq, E] -> the model's output [batch, seq, E], all-reduced (the same on
        every rank). key_mask [batch, seq] bool (True = token; None: all tokens); rows at
        padded query positions are 0 in the output; `causal`: query i sees keys j <= i."""
        ...

    def warm_local(self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        """Run the kernels a step of this shape uses on this rank alone, with no collective
        (a warm-up that cannot desynchronise the group); the result is discarded."""
        ...

    def append(self, x: torch.Tensor, plan: AppendPlan, pool: PagedKVPool) -> torch.Tensor:
        """A session step: x [T, E] are the new rows of the plan's sessions; writes their K/V
        into `pool` (one layer per `ModelDef.kv_layers`) and returns the rows' outputs [T, E],
        all-reduced: row j of session i equals the model's causal output at position c_i + j
        over the session's whole sequence (service.parallel.kv_cache)."""
        ...

    def load_shard(self, shard: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's slices (names as `ModelDef.params`) into the module."""
        ...

    def parameter_bytes(self) -> int:
        ...


class ModelDef(Protocol):
    """An architecture (module docstring). Plain data: picklable, cheap to construct."""

    kind: str  # "attention", "transformer", or the import path of a user's factory
    embed_dim: int  # E: the width of every request and reply row

    def params(self) -> tuple[ParamSpec, ...]:
        """Every dense parameter, in checkpoint order."""
        ...

    def check_world_size(self, world_size: int) -> None:
        """ValueError naming the numbers when this model cannot be split `world_size` ways."""
        ...

    @property
    def kv_layers(self) -> int:
        """Layers that keep a session K/V cache (0: the model has no sessions)."""
        ...

    @property
    def kv_heads(self) -> int:
        """Attention heads per cached layer (split over ranks like the weights)."""
        ...

    @property
    def head_dim(self) -> int:
        ...

    def init_weights(self, init: str, seed: int) -> DenseWeights:
        """Dense weights from `init` ("seed" | "random") and `seed`, float32, identical for every
        world size (so every gang size serves the same function)."""
        ...

    def dense_module(self) -> nn.Module:
        """The dense reference torch module: its `state_dict()` has exactly `params()`' names and
        shapes; tests compare against it and training trains it."""
        ...

    def dense_forward(self, module: nn.Module, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                      causal: bool = False) -> torch.Tensor:
        """`dense_module()`'s output under the service's contract (what the gang must equal, and
        training's forward): x [batch, seq, E], key_mask [batch, seq] bool, rows at padded
        query positions 0."""
        ...

    def build(self, group: ParallelGroup, dtype: torch.dtype) -> RankModel:
        """Rank `group.rank`'s local module, parameters uninitialised until `load_shard`."""
        ...

    def metadata(self) -> dict[str, str]:
        """What a checkpoint of this model records (safetensors metadata), checked on load."""
        ...


# -- what every model shares: the sharding, the checkpoint file, the KV width ----------------
def check_world_size(model: ModelDef, world_size: int) -> None:
    """The generic part of `ModelDef.check_world_size`: every parameter divides."""
    refuse_split(model.kind, world_size, [why for spec in model.params() if (why := spec.check_divides(world_size))])


def refuse_split(kind: str, world_size: int, problems: list[str]) -> None:
    """ValueError naming the model and the world size, then each problem (each names its own
    numbers); nothing when `problems` is empty."""
    if problems:
        raise ValueError(f"model {kind} cannot be split over world_size {world_size}: " + "; ".join(problems))


def kv_heads_per_rank(model: ModelDef, world_size: int) -> int:
    """The K/V heads one rank caches: kv_heads / p, or 1 when there are fewer K/V heads than
    ranks (grouped-query attention: each K/V head is then held by p / kv_heads ranks)."""
    return max(model.kv_heads // world_size, 1)


def kv_bytes_per_token(model: ModelDef, world_size: int, dtype_bytes: int) -> int:
    """Session cache bytes per token per rank: 2 (K and V) x kv_layers x kv_heads_per_rank x head_dim x dtype."""
    return 2 * model.kv_layers * kv_heads_per_rank(model, world_size) * model.head_dim * dtype_bytes


def new_kv_pool(model: ModelDef, world_size: int, plan: AppendPlan, dtype: torch.dtype,
                device: torch.device) -> PagedKVPool:
    """This rank's session pool for `model` in the plan's shape (one layer per cached layer)."""
    return PagedKVPool(plan.num_blocks, plan.block_size, kv_heads_per_rank(model, world_size), model.head_dim, dtype,
                       device, layers=model.kv_layers)


def is_causal_only(model: ModelDef) -> bool:
    """A model that declares itself causal (a decoder: `causal_only = True`): its requests are
    causal by default and a request for bidirectional attention is refused. A model that does
    not declare it (a user's, written before the attribute existed) is not."""
    return bool(getattr(model, "causal_only", False))


def ignored_weights(model: ModelDef) -> tuple[str, ...]:
    """Name prefixes of checkpoint tensors the model does not use and never loads (a decoder
    stack's `embed_tokens.`, `lm_head.`); any other unexpected tensor is an error."""
    return tuple(getattr(model, "ignored_weights", ()))


def validate_shapes(model: ModelDef, shapes: Mapping[str, tuple[int, ...]], what: str = "dense weights") -> None:
    """ValueError listing every missing, unexpected or wrong-shaped tensor of `shapes` (name -> shape).
    Tensors under the model's `ignored_weights` prefixes are not unexpected."""
    problems = []
    declared = {spec.name: spec for spec in model.params()}
    for name, spec in declared.items():
        if name not in shapes:
            problems.append(f"missing {name!r} {list(spec.shape)}")
        elif tuple(shapes[name]) != spec.shape:
            problems.append(f"{name} has shape {list(shapes[name])}, the model needs {list(spec.shape)}")
    skipped = ignored_weights(model)
    unexpected = sorted(n for n in set(shapes) - set(declared) if not n.startswith(skipped))
    if unexpected:
        problems.append(f"unexpected {', '.join(repr(n) for n in unexpected[:10])}"
                        + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""))
    if problems:
        raise ValueError(f"{what} do not fit model {describe(model)}: " + "; ".join(problems))


def validate_dense(model: ModelDef, weights: Mapping[str, torch.Tensor], what: str = "dense weights") -> None:
    """`validate_shapes` of a dict of tensors."""
    validate_shapes(model, {k: tuple(v.shape) for k, v in weights.items()}, what)


def shard_dense(model: ModelDef, weights: DenseWeights, rank: int, world_size: int) -> DenseWeights:
    """Rank's slice of dense weights."""
    validate_dense(model, weights)
    return {spec.name: spec.take(weights[spec.name], rank, world_size).contiguous() for spec in model.params()}


# A Hugging Face `save_pretrained` directory: one file, or shards listed by an index.
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_PREFIX = "model."  # a *ForCausalLM's decoder stack, under its `model` attribute


@dataclass(frozen=True)
class CheckpointTensors:
    """Where each tensor of a checkpoint lives, read from headers only (no tensor data).

    A checkpoint is one safetensors file (names as they are), or a Hugging Face
    `save_pretrained` directory: `model.safetensors`, or the shards its
    `model.safetensors.index.json` lists, names without their `model.` prefix (a
    `LlamaForCausalLM`'s stack is its `model`; a `LlamaModel` has none)."""

    path: Path
    metadata: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    places: dict[str, tuple[Path, str]]  # name -> (file, the tensor's key in that file)

    def by_file(self, names: list[str]) -> dict[Path, list[str]]:
        """`names` grouped by the file that holds each (every file opened once)."""
        groups: dict[Path, list[str]] = {}
        for name in names:
            groups.setdefault(self.places[name][0], []).append(name)
        return groups


def _checkpoint_files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    index = path / HF_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"checkpoint {index} is not a safetensors index (a 'weight_map' of names to "
                             f"files): {exc}") from None
        files = sorted({str(f) for f in weight_map.values()})
        if any(Path(f).is_absolute() or ".." in Path(f).parts for f in files):
            raise ValueError(f"checkpoint {index} names files outside its directory: {files}")
        return [path / f for f in files]
    if (path / HF_WEIGHTS).is_file():
        return [path / HF_WEIGHTS]
    raise ValueError(f"checkpoint directory {path} has neither {HF_WEIGHTS} nor {HF_INDEX} "
                     "(a Hugging Face save_pretrained directory with safetensors weights)")


def open_checkpoint(path: str | Path) -> CheckpointTensors:
    """The tensors of a checkpoint file or directory (`CheckpointTensors`); ValueError naming
    the file safetensors cannot open (bad header, truncated data) or a name held twice."""
    root = Path(path)
    metadata: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    places: dict[str, tuple[Path, str]] = {}
    for file in _checkpoint_files(root):
        try:
            with safe_open(str(file), framework="pt") as f:
                metadata.update(f.metadata() or {})
                for key in f.keys():
                    name = key[len(HF_PREFIX):] if root.is_dir() and key.startswith(HF_PREFIX) else key
                    if name in places:
                        raise ValueError(f"checkpoint {root}: tensor {name!r} is held twice ({places[name][1]!r} "
                                         f"in {places[name][0].name}, {key!r} in {file.name})")
                    shapes[name] = tuple(f.get_slice(key).get_shape())
                    places[name] = (file, key)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"checkpoint {file} is not a readable safetensors file: {exc}") from None
    return CheckpointTensors(root, metadata, shapes, places)


def read_checkpoint_header(path: str | Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """(metadata, tensor shapes) of a checkpoint (`open_checkpoint`), without reading tensor data."""
    tensors = open_checkpoint(path)
    return tensors.metadata, tensors.shapes


def check_checkpoint(model: ModelDef, path: str | Path) -> None:
    """ValueError unless `path` holds exactly `model`'s dense tensors (names and shapes; tensors
    the model ignores aside) and records no other architecture in its metadata; the message
    lists every difference."""
    meta, shapes = read_checkpoint_header(path)
    problems = [f"metadata {key}={meta[key]}, the model needs {want}"
                for key, want in model.metadata().items() if key in meta and str(meta[key]) != want]
    try:
        validate_shapes(model, shapes, what="its tensors")
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise ValueError(f"checkpoint {path} does not fit model {describe(model)}: " + "; ".join(problems))


def unused_tensors(model: ModelDef, path: str | Path) -> list[str]:
    """The checkpoint's tensors the model ignores (its `ignored_weights`), never read."""
    declared = {spec.name for spec in model.params()}
    return sorted(set(open_checkpoint(path).shapes) - declared)


def load_checkpoint_shard(model: ModelDef, path: str | Path, rank: int, world_size: int,
                          dtype: torch.dtype = torch.float32) -> DenseWeights:
    """Read only rank's slice of each of the model's tensors of a checkpoint, straight into
    `dtype` (the rank's compute dtype: a bf16 checkpoint served in bf16 is never widened):
    `get_slice` memory-maps each file and copies just the requested rows/columns."""
    tensors = open_checkpoint(path)
    specs = {spec.name: spec for spec in model.params()}
    shard: DenseWeights = {}
    for file, names in tensors.by_file(list(specs)).items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                piece = specs[name].take(f.get_slice(tensors.places[name][1]), rank, world_size)
                shard[name] = piece.to(dtype).contiguous()
    return {name: shard[name] for name in specs}  # params() order


def save_checkpoint(model: ModelDef, path: str | Path, weights: Mapping[str, torch.Tensor],
                    extra_metadata: Mapping[str, str] | None = None) -> None:
    """Write dense weights (float32, in `params()` order) with the model's metadata."""
    validate_dense(model, weights)
    tensors = {spec.name: weights[spec.name].detach().to(torch.float32).contiguous().cpu() for spec in model.params()}
    save_file(tensors, str(path), metadata={**model.metadata(), **(extra_metadata or {})})


def dense_state(model: ModelDef, module: nn.Module) -> DenseWeights:
    """The dense weights a reference/training module holds, by `params()` name (float32, detached)."""
    state = module.state_dict()
    validate_dense(model, state, what="the module's state_dict")
    return {spec.name: state[spec.name].detach().to(torch.float32).cpu().clone() for spec in model.params()}


def load_shard_into(module: nn.Module, shard: Mapping[str, torch.Tensor]) -> None:
    """Copy a rank's slices into `module`'s parameters of the same names (every one needed),
    refusing a wrong shape and weights the compute dtype cannot hold (all checked before any is
    written). A CPU module's large parameters get fresh storage on huge pages first
    (service.parallel.huge_pages: every decode step reads them all), which these copies touch
    first."""
    params = dict(module.named_parameters())
    for name, param in params.items():
        if name not in shard:
            raise KeyError(f"shard is missing {name!r}; has {sorted(shard)}")
        src = shard[name]
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"{name}: shard has shape {tuple(src.shape)}, this rank needs {tuple(param.shape)}")
        check_representable(name, src, param.dtype)
    move_parameters(module, keep_values=False)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(shard[name].to(dtype=param.dtype, device=param.device))


def check_representable(name: str, src: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse weights the compute dtype cannot hold: a copy would store inf (float16's
    largest finite value is 65504; the seed init reaches E*E), and every answer would be
    NaN with a 200."""
    if not dtype.is_floating_point or src.numel() == 0:
        return
    peak = float(src.detach().abs().max())
    limit = float(torch.finfo(dtype).max)
    if not peak <= limit:  # also NaN
        raise ValueError(
            f"{name}: weight magnitudes reach {peak:.6g}, beyond {dtype}'s largest finite value "
            f"{limit:.6g}; these weights cannot be computed in {dtype} (use bfloat16 or float32)"
        )


def describe(model: ModelDef) -> str:
    return ", ".join(f"{k}={v}" for k, v in model.metadata().items())
