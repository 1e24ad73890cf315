"""How a model's dense parameters are named, shaped and split over a gang: torch-free, so the
processes that load no torch (the JobManager, the builder arguments) describe a checkpoint
with the same declarations the ranks load it by.

Sharding (`Shard`), for rank r of p, of a dense tensor in torch's Linear convention
(weight [out, in], y = x W^T + b):

    COLUMN      rows r*out/p : (r+1)*out/p of the weight (and of a bias): Y_r = X A_r^T + b_r,
                this rank's slice of the output features (ColumnParallelLinear). With
                `parts` = k, dim 0 is k equal blocks stacked (torch's fused in_proj
                [3E, E] = [W_q; W_k; W_v]) and the rank takes its slice of each block, in
                block order: one fused GEMM [k*out/p, in] per rank. With `groups` = g
                (attention heads), dim 0 is g equal units split by whole units: g >= p,
                rank r takes units r*g/p : (r+1)*g/p; g < p (fewer K/V heads than ranks,
                grouped-query attention), each unit is held by p/g ranks and rank r takes
                unit r*g // p (vLLM's `num_kv_head_replicas`).
    ROW         columns r*in/p : (r+1)*in/p of the weight: partial products summed by one
                all_reduce (RowParallelLinear).
    REPLICATED  the whole tensor on every rank (norms, the bias of a ROW layer: added once,
                after the all_reduce).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Shard(enum.Enum):
    """How one dense tensor is split over the gang (module docstring)."""

    COLUMN = "column"
    ROW = "row"
    REPLICATED = "replicated"


@dataclass(frozen=True)
class ParamSpec:
    """One dense parameter: its name in the reference module's `state_dict()` (and in the
    checkpoint), its dense shape, and how it is sharded (`parts`: fused blocks on dim 0;
    `groups`: whole units on dim 0, replicated when fewer than ranks; module docstring)."""

    name: str
    shape: tuple[int, ...]
    shard: Shard
    parts: int = 1
    groups: int = 0

    def check_divides(self, world_size: int) -> str | None:
        """Why this parameter cannot be split `world_size` ways, or None."""
        if self.shard is Shard.COLUMN and self.groups:
            g = self.groups
            if self.shape[0] % g or (g % world_size and world_size % g):
                return (f"{self.name}: {g} heads cannot be split over world_size {world_size}: the heads must be "
                        f"a multiple of the world size, or the world size a multiple of the heads (each head then "
                        f"held by world_size / heads ranks)")
            return None
        if self.shard is Shard.COLUMN and self.shape[0] % (self.parts * world_size):
            return (f"{self.name}: dim 0 ({self.shape[0]} = {self.parts} block(s)) is not divisible into "
                    f"{world_size} rank slices per block")
        if self.shard is Shard.ROW and (len(self.shape) < 2 or self.shape[1] % world_size):
            return f"{self.name}: dim 1 ({self.shape[1] if len(self.shape) > 1 else '-'}) is not divisible by {world_size}"
        return None

    def take(self, tensor: Any, rank: int, world_size: int) -> Any:
        """Rank's slice of the dense `tensor`: a torch tensor, or a safetensors slice
        (`safe_open(...).get_slice(name)`), which then reads only these rows/columns."""
        if self.shard is Shard.REPLICATED:
            return tensor[...] if hasattr(tensor, "get_shape") else tensor  # a safetensors slice reads it all
        if self.shard is Shard.ROW:
            per = self.shape[1] // world_size
            return tensor[:, rank * per:(rank + 1) * per]
        if self.groups:
            unit = self.shape[0] // self.groups
            units = max(self.groups // world_size, 1)
            first = rank * self.groups // world_size  # units >= 1 per rank, or one unit per world_size/groups ranks
            return tensor[first * unit:(first + units) * unit]
        block = self.shape[0] // self.parts
        per = block // world_size
        pieces = [tensor[b * block + rank * per:b * block + (rank + 1) * per] for b in range(self.parts)]
        if self.parts == 1:
            return pieces[0]
        import torch  # only a rank slices fused blocks, and a rank has torch

        return torch.cat(pieces, dim=0)


class AttentionHeads:
    """The session cache of a model whose cached layers are `num_heads` heads of
    `embed_dim / num_heads` each, split over ranks by whole heads (the built-in models)."""

    embed_dim: int
    num_heads: int

    @property
    def kv_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def head_problems(self, world_size: int) -> list[str]:
        """Why the heads cannot be split `world_size` ways (empty: they can)."""
        problems = []
        if self.embed_dim % self.num_heads:
            problems.append(f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % world_size:
            problems.append(f"num_heads ({self.num_heads}) must be divisible by world_size ({world_size}): each "
                            "rank computes num_heads / world_size whole heads")
        return problems


def parameter_count(specs: tuple[ParamSpec, ...]) -> int:
    """How many dense parameters `specs` declare (a model's `params()`), summed over their shapes."""
    total = 0
    for spec in specs:
        n = 1
        for d in spec.shape:
            n *= d
        total += n
    return total
