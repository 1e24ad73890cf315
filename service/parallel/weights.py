"""Dense attention weights: deterministic/random init, the checkpoint format, and sharding.

Dense layout (the checkpoint contract): keys `{q,k,v,out}_proj.{weight,bias}`, weights
[E, E] in torch Linear convention ([out, in]), biases [E]; safetensors metadata
`embed_dim`, `num_heads`. Rank r of p owns:

    q/k/v weight rows    r*E/p : (r+1)*E/p   (ColumnParallelLinear), bias: same slice
    out weight columns   r*E/p : (r+1)*E/p   (RowParallelLinear),    bias: all of it
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj")
DENSE_KEYS = tuple(f"{p}.{kind}" for p in PROJECTIONS for kind in ("weight", "bias"))

# The original notes' offsets for their deterministic init (docs/seed-notes.md).
SEED_OFFSETS = {"q_proj": 0.1, "k_proj": -0.2, "v_proj": 0.3, "out_proj": -0.4}

DenseWeights = dict[str, torch.Tensor]


def seed_weights(embed_dim: int) -> DenseWeights:
    """The notes' weights: W[i, j] = i * E + j + offset, b[i] = i + offset, in float32.

    Computed exactly as the notes do (integer arange, then `+= offset` in float32), so
    values such as 262143.1 round to the same float32 as theirs.
    """
    weights: DenseWeights = {}
    for name, offset in SEED_OFFSETS.items():
        w = torch.arange(embed_dim * embed_dim, dtype=torch.float32).reshape(embed_dim, embed_dim)
        b = torch.arange(embed_dim, dtype=torch.float32)
        weights[f"{name}.weight"] = w + offset
        weights[f"{name}.bias"] = b + offset
    return weights


def random_weights(embed_dim: int, seed: int) -> DenseWeights:
    """Reproducible random weights: U(-1/sqrt(E), 1/sqrt(E)) from a generator seeded with `seed`.

    Independent of world size, so every gang size serves the same function.
    """
    gen = torch.Generator().manual_seed(seed)
    bound = embed_dim**-0.5
    weights: DenseWeights = {}
    for name in PROJECTIONS:
        w = torch.rand(embed_dim, embed_dim, generator=gen, dtype=torch.float32)
        b = torch.rand(embed_dim, generator=gen, dtype=torch.float32)
        weights[f"{name}.weight"] = (w * 2 - 1) * bound
        weights[f"{name}.bias"] = (b * 2 - 1) * bound
    return weights


def validate_dense(weights: DenseWeights, embed_dim: int) -> None:
    """Raise ValueError naming every missing key or wrong shape."""
    problems = []
    for key in DENSE_KEYS:
        want = (embed_dim, embed_dim) if key.endswith("weight") else (embed_dim,)
        if key not in weights:
            problems.append(f"missing {key!r}")
        elif tuple(weights[key].shape) != want:
            problems.append(f"{key} has shape {tuple(weights[key].shape)}, expected {want}")
    if problems:
        raise ValueError("dense attention weights invalid: " + "; ".join(problems))


def shard_bounds(embed_dim: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's slice of the sharded dimension."""
    if embed_dim % world_size:
        raise ValueError(f"embed_dim {embed_dim} is not divisible by world_size {world_size}")
    per_rank = embed_dim // world_size
    return rank * per_rank, (rank + 1) * per_rank


def shard_dense(weights: DenseWeights, rank: int, world_size: int) -> DenseWeights:
    """Rank's slice of dense weights (see module docstring for the layout)."""
    embed_dim = weights["q_proj.weight"].shape[0]
    validate_dense(weights, embed_dim)
    lo, hi = shard_bounds(embed_dim, rank, world_size)
    shard: DenseWeights = {}
    for name in COLUMN_PARALLEL:
        shard[f"{name}.weight"] = weights[f"{name}.weight"][lo:hi, :].contiguous()
        shard[f"{name}.bias"] = weights[f"{name}.bias"][lo:hi].contiguous()
    shard["out_proj.weight"] = weights["out_proj.weight"][:, lo:hi].contiguous()
    shard["out_proj.bias"] = weights["out_proj.bias"].clone()
    return shard


def save_checkpoint(path: str | Path, weights: DenseWeights, num_heads: int, causal: bool | None = None) -> None:
    """Write dense weights in the contract's safetensors format; `causal` (when given) is
    recorded as metadata `causal` = "true" | "false", the served default for the weights."""
    embed_dim = weights["q_proj.weight"].shape[0]
    validate_dense(weights, embed_dim)
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
    tensors = {k: weights[k].detach().to(torch.float32).contiguous().cpu() for k in DENSE_KEYS}
    metadata = {"embed_dim": str(embed_dim), "num_heads": str(num_heads)}
    if causal is not None:
        metadata["causal"] = "true" if causal else "false"
    save_file(tensors, str(path), metadata=metadata)


def checkpoint_causal(path: str | Path) -> bool | None:
    """The `causal` a checkpoint records (None: it records none, or says something else)."""
    value = str(read_checkpoint_header(path)["metadata"].get("causal", "")).strip().lower()  # type: ignore[union-attr]
    return {"true": True, "false": False}.get(value)


def read_checkpoint_header(path: str | Path) -> dict[str, object]:
    """Metadata and tensor shapes of a checkpoint, without reading tensor data.

    Raises ValueError for a file safetensors cannot open (bad header, truncated data)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except SafetensorError as exc:
        raise ValueError(f"checkpoint {path} is not a readable safetensors file: {exc}") from None
    return {"metadata": meta, "shapes": shapes}


def check_checkpoint(path: str | Path, embed_dim: int, num_heads: int) -> None:
    """Raise ValueError unless `path` is a dense checkpoint for (embed_dim, num_heads)."""
    header = read_checkpoint_header(path)
    meta = header["metadata"]
    shapes: dict = header["shapes"]  # type: ignore[assignment]
    problems = []
    for key, want in (("embed_dim", embed_dim), ("num_heads", num_heads)):
        got = meta.get(key)  # type: ignore[union-attr]
        if got is not None and str(got) != str(want):
            problems.append(f"metadata {key}={got}, the model needs {want}")
    for key in DENSE_KEYS:
        want_shape = (embed_dim, embed_dim) if key.endswith("weight") else (embed_dim,)
        if key not in shapes:
            problems.append(f"missing tensor {key!r}")
        elif shapes[key] != want_shape:
            problems.append(f"{key} has shape {shapes[key]}, the model needs {want_shape}")
    if problems:
        raise ValueError(f"checkpoint {path} does not fit the model: " + "; ".join(problems))


def load_checkpoint_shard(path: str | Path, rank: int, world_size: int) -> DenseWeights:
    """Read only rank's slice of each tensor from a dense safetensors checkpoint.

    `safe_open(...).get_slice` memory-maps the file and copies just the requested
    rows/columns, so a rank never materialises the other ranks' parameters.
    """
    shard: DenseWeights = {}
    with safe_open(str(path), framework="pt") as f:
        embed_dim = int(f.get_slice("q_proj.weight").get_shape()[0])
        lo, hi = shard_bounds(embed_dim, rank, world_size)
        for name in COLUMN_PARALLEL:
            shard[f"{name}.weight"] = f.get_slice(f"{name}.weight")[lo:hi, :]
            shard[f"{name}.bias"] = f.get_slice(f"{name}.bias")[lo:hi]
        shard["out_proj.weight"] = f.get_slice("out_proj.weight")[:, lo:hi]
        shard["out_proj.bias"] = f.get_tensor("out_proj.bias")
    return {k: v.to(torch.float32).contiguous() for k, v in shard.items()}
