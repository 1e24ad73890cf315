"""`model=attention`'s architecture, torch-free: one multi-head self-attention layer of width
E with H heads, `nn.MultiheadAttention(E, H, bias=True, batch_first=True)`; its torch half is
service.parallel.attention.

Its checkpoint is the contract's dense format: `{q,k,v,out}_proj.{weight,bias}`, weights
[E, E] in torch's Linear convention ([out, in]), biases [E]; metadata `embed_dim`,
`num_heads` (no `model`: the format predates the other kinds). Rank r of p holds the q/k/v
rows of its heads (COLUMN) and the out projection's columns (ROW; its bias whole)."""
from __future__ import annotations

from dataclasses import dataclass

from service.models.params import AttentionHeads, ParamSpec, Shard

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


@dataclass(frozen=True)
class AttentionArch(AttentionHeads):
    """One attention layer of width E with H heads."""

    embed_dim: int = 512
    num_heads: int = 8
    kind: str = "attention"

    def params(self) -> tuple[ParamSpec, ...]:
        """The four projections' weights and biases, in checkpoint order (module docstring)."""
        e, specs = self.embed_dim, []
        for name in PROJECTIONS:
            column = name != "out_proj"
            specs.append(ParamSpec(f"{name}.weight", (e, e), Shard.COLUMN if column else Shard.ROW))
            specs.append(ParamSpec(f"{name}.bias", (e,), Shard.COLUMN if column else Shard.REPLICATED))
        return tuple(specs)

    def problems(self, world_size: int) -> list[str]:
        return self.head_problems(world_size)

    @property
    def kv_layers(self) -> int:
        return 1

    def metadata(self) -> dict[str, str]:
        # The contract's format (service.parallel.weights.save_checkpoint) records no `model`.
        return {"embed_dim": str(self.embed_dim), "num_heads": str(self.num_heads)}
