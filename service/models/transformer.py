"""`model=transformer`'s architecture, torch-free: `nn.TransformerEncoder(nn.TransformerEncoderLayer(
E, H, ffn_dim, dropout=0, activation, batch_first=True, norm_first, layer_norm_eps), num_layers)`
(no final norm); its torch half is service.parallel.transformer.

Its checkpoint is that module's own `state_dict()` (`layers.{i}.self_attn.in_proj_weight`, ...)
with this architecture in its metadata. Rank r of p holds its heads' rows of the fused q/k/v
(COLUMN, 3 blocks), the out projection's and linear2's columns (ROW), linear1's rows (COLUMN);
norms and the ROW layers' biases whole."""
from __future__ import annotations

from dataclasses import dataclass

from service.models.params import AttentionHeads, ParamSpec, Shard

ACTIVATIONS = ("relu", "gelu")


@dataclass(frozen=True)
class TransformerArch(AttentionHeads):
    """The stack's architecture."""

    num_layers: int = 2
    embed_dim: int = 512
    num_heads: int = 8
    ffn_dim: int = 2048
    activation: str = "relu"
    norm_first: bool = False
    layer_norm_eps: float = 1e-5
    kind: str = "transformer"

    def params(self) -> tuple[ParamSpec, ...]:
        """Every layer's tensors, in torch's state_dict order (module docstring)."""
        e, f, col, row, rep = self.embed_dim, self.ffn_dim, Shard.COLUMN, Shard.ROW, Shard.REPLICATED
        P = ParamSpec
        specs: list[ParamSpec] = []
        for i in range(self.num_layers):
            at = f"layers.{i}."
            specs += [
                P(at + "self_attn.in_proj_weight", (3 * e, e), col, parts=3),
                P(at + "self_attn.in_proj_bias", (3 * e,), col, parts=3),
                P(at + "self_attn.out_proj.weight", (e, e), row),
                P(at + "self_attn.out_proj.bias", (e,), rep),
                P(at + "linear1.weight", (f, e), col),
                P(at + "linear1.bias", (f,), col),
                P(at + "linear2.weight", (e, f), row),
                P(at + "linear2.bias", (e,), rep),
                P(at + "norm1.weight", (e,), rep),
                P(at + "norm1.bias", (e,), rep),
                P(at + "norm2.weight", (e,), rep),
                P(at + "norm2.bias", (e,), rep),
            ]
        return tuple(specs)

    def problems(self, world_size: int) -> list[str]:
        """Why the stack cannot be split `world_size` ways (empty: it can), naming the numbers."""
        problems = self.head_problems(world_size)
        if self.ffn_dim % world_size:
            problems.append(f"ffn_dim ({self.ffn_dim}) must be divisible by world_size ({world_size}): each rank "
                            "holds ffn_dim / world_size of the MLP's hidden units")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation {self.activation!r} is not one of {sorted(ACTIVATIONS)}")
        return problems

    @property
    def kv_layers(self) -> int:
        return self.num_layers

    def metadata(self) -> dict[str, str]:
        return {"model": "transformer", "num_layers": str(self.num_layers), "embed_dim": str(self.embed_dim),
                "num_heads": str(self.num_heads), "ffn_dim": str(self.ffn_dim), "activation": self.activation,
                "norm_first": str(self.norm_first).lower(), "layer_norm_eps": repr(float(self.layer_norm_eps))}
