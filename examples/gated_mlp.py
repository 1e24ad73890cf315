"""A user's model, served tensor-parallel: a gated MLP block with a residual (docs/models.md).

    y = x + W_down (silu(W_gate x + b_gate) * (W_up x + b_up)) + b_down

Sharded column -> row, as Megatron shards an MLP: `gate_up.weight` [2F, E] is W_gate stacked
on W_up (COLUMN, 2 blocks: rank r holds its F/p rows of each, one fused GEMM), `down.weight`
[E, F] is ROW (rank r holds columns r*F/p .. (r+1)*F/p), so the block costs one all_reduce;
`down.bias` is replicated and added once, after it.

    serve run service.app:build_app world_size=2 model=examples.gated_mlp:gated_mlp \
        embed_dim=256 'model_args={"hidden_dim": 1024}' init=random

It is position-wise (no attention), so it keeps no session cache (`kv_layers` 0: sessions are
off for it) and `causal` changes nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from service.parallel.group import ParallelGroup
from service.parallel.model import ParamSpec, RankModel, Shard, check_world_size, load_shard_into


class GatedMLP(nn.Module):
    """The dense reference and training module; its state_dict names are the checkpoint's."""

    def __init__(self, embed_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(embed_dim, 2 * hidden_dim)
        self.down = nn.Linear(hidden_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ParallelGatedMLP(nn.Module):
    """Rank r's shard: gate_up [2F/p, E] (its rows of each block), down [E, F/p] + bias."""

    def __init__(self, embed_dim: int, hidden_dim: int, group: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.group = group
        local = hidden_dim // group.world_size
        self.gate_up = nn.Linear(embed_dim, 2 * local, dtype=dtype, device=group.device)
        self.down = nn.Linear(local, embed_dim, dtype=dtype, device=group.device)
        self.requires_grad_(False)

    def _partial(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [..., F/p] each: this rank's hidden units
        return F.linear(F.silu(gate) * up, self.down.weight)  # [..., E], this rank's share

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        out = self.group.all_reduce_(self._partial(x)).add_(self.down.bias).add_(x)  # [batch, seq, E]
        return out if key_mask is None else out.masked_fill_(~key_mask[..., None], 0.0)

    def warm_local(self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        return self._partial(x)

    def append(self, x, plan, pool):  # type: ignore[no-untyped-def] - never called: kv_layers is 0
        raise NotImplementedError("the gated MLP keeps no session cache")

    def load_shard(self, shard: dict[str, torch.Tensor]) -> None:
        load_shard_into(self, shard)

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


@dataclass(frozen=True)
class GatedMLPDef:
    """The architecture (service.parallel.model.ModelDef)."""

    embed_dim: int
    hidden_dim: int
    kind: str = "examples.gated_mlp:gated_mlp"
    kv_layers: int = 0  # position-wise: nothing to cache
    kv_heads: int = 1
    head_dim: int = 1

    def params(self) -> tuple[ParamSpec, ...]:
        e, f = self.embed_dim, self.hidden_dim
        return (ParamSpec("gate_up.weight", (2 * f, e), Shard.COLUMN, parts=2),
                ParamSpec("gate_up.bias", (2 * f,), Shard.COLUMN, parts=2),
                ParamSpec("down.weight", (e, f), Shard.ROW),
                ParamSpec("down.bias", (e,), Shard.REPLICATED))

    def check_world_size(self, world_size: int) -> None:
        check_world_size(self, world_size)

    def init_weights(self, init: str, seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        weights = {}
        for spec in self.params():
            fan_in = self.embed_dim if spec.name.startswith("gate_up") else self.hidden_dim
            weights[spec.name] = (torch.rand(spec.shape, generator=gen) * 2 - 1) / math.sqrt(fan_in)
        return weights

    def dense_module(self) -> nn.Module:
        return GatedMLP(self.embed_dim, self.hidden_dim)

    def dense_forward(self, module: nn.Module, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                      causal: bool = False) -> torch.Tensor:
        out = module(x)
        return out if key_mask is None else out.masked_fill(~key_mask[..., None], 0.0)

    def build(self, group: ParallelGroup, dtype: torch.dtype) -> RankModel:
        self.check_world_size(group.world_size)
        return ParallelGatedMLP(self.embed_dim, self.hidden_dim, group, dtype)

    def metadata(self) -> dict[str, str]:
        return {"model": self.kind, "embed_dim": str(self.embed_dim), "hidden_dim": str(self.hidden_dim)}


def gated_mlp(embed_dim: int, hidden_dim: int = 1024) -> GatedMLPDef:
    """The factory the builder arguments name: `model=examples.gated_mlp:gated_mlp`."""
    return GatedMLPDef(embed_dim, hidden_dim)
