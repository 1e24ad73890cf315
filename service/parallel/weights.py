"""The attention model's dense weights: deterministic/random init, the checkpoint format, and sharding.

Dense layout (the checkpoint contract): keys `{q,k,v,out}_proj.{weight,bias}`, weights
[E, E] in torch Linear convention ([out, in]), biases [E]; safetensors metadata
`embed_dim`, `num_heads`. Rank r of p owns:

    q/k/v weight rows    r*E/p : (r+1)*E/p   (ColumnParallelLinear), bias: same slice
    out weight columns   r*E/p : (r+1)*E/p   (RowParallelLinear),    bias: all of it
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from service.models.attention import PROJECTIONS, AttentionArch
from service.parallel.model import read_checkpoint_header


# The original notes' offsets for their deterministic init (docs/design.md#the-original-notes-seed-weights).
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


def shard_dense(weights: DenseWeights, rank: int, world_size: int) -> DenseWeights:
    """Rank's slice of dense attention weights (see module docstring for the layout)."""
    embed_dim = weights["q_proj.weight"].shape[0]
    if embed_dim % world_size:
        raise ValueError(f"embed_dim {embed_dim} is not divisible by world_size {world_size}")
    specs = AttentionArch(embed_dim).params()
    missing = [spec.name for spec in specs if spec.name not in weights]
    if missing:
        raise ValueError(f"dense attention weights invalid: missing {missing}")
    return {spec.name: spec.take(weights[spec.name], rank, world_size).contiguous() for spec in specs}


def save_checkpoint(path: str | Path, weights: DenseWeights, num_heads: int, causal: bool | None = None) -> None:
    """Write dense weights in the contract's safetensors format; `causal` (when given) is
    recorded as metadata `causal` = "true" | "false", the served default for the weights."""
    embed_dim = weights["q_proj.weight"].shape[0]
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
    specs = AttentionArch(embed_dim).params()
    tensors = {spec.name: weights[spec.name] for spec in specs if spec.name in weights}
    problems = [f"missing {spec.name!r}" if spec.name not in weights else
                f"{spec.name} has shape {tuple(weights[spec.name].shape)}, expected {spec.shape}"
                for spec in specs if spec.name not in weights or tuple(weights[spec.name].shape) != spec.shape]
    if problems:
        raise ValueError("dense attention weights invalid: " + "; ".join(problems))
    metadata = {"embed_dim": str(embed_dim), "num_heads": str(num_heads)}
    if causal is not None:
        metadata["causal"] = "true" if causal else "false"
    save_file({k: v.detach().to(torch.float32).contiguous().cpu() for k, v in tensors.items()}, str(path),
              metadata=metadata)


def checkpoint_causal(path: str | Path) -> bool | None:
    """The `causal` a checkpoint records (None: it records none, or says something else)."""
    metadata, _ = read_checkpoint_header(path)
    return {"true": True, "false": False}.get(str(metadata.get("causal", "")).strip().lower())
