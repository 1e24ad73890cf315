"""`model=attention` (the default): one multi-head self-attention layer,
`nn.MultiheadAttention(E, H, bias=True, batch_first=True)`, with the contract's checkpoint
format (`{q,k,v,out}_proj.{weight,bias}`, service.parallel.weights)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

import service.parallel.model as seam
from service.models.attention import AttentionArch
from service.parallel.group import ParallelGroup
from service.parallel.layers import TensorParallelAttention, sdpa_mask
from service.parallel.weights import random_weights, seed_weights


class DenseAttention(nn.Module):
    """The dense reference: torch's own multi-head attention (`F.multi_head_attention_forward`
    with separate q/k/v projections) over parameters named as the checkpoint names them.
    Output rows at padded query positions are 0."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(3))
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        """x [batch, seq, E]; key_mask [batch, seq] bool (True = token)."""
        batch, seq, _ = x.shape
        mask = None
        if key_mask is not None or causal:
            tokens = key_mask if key_mask is not None else torch.ones(batch, seq, dtype=torch.bool, device=x.device)
            allowed = sdpa_mask(tokens, True, x.dtype) if causal else \
                torch.zeros(batch, 1, 1, seq, dtype=x.dtype, device=x.device).masked_fill(
                    ~tokens[:, None, None, :], float("-inf"))
            mask = allowed.expand(batch, self.num_heads, seq, seq).reshape(batch * self.num_heads, seq, seq)
        xt = x.transpose(0, 1)  # [seq, batch, E]: F.multi_head_attention_forward's layout
        out, _ = F.multi_head_attention_forward(
            xt, xt, xt, self.embed_dim, self.num_heads, None, torch.cat([self.q_proj.bias, self.k_proj.bias,
                                                                         self.v_proj.bias]),
            None, None, False, 0.0, self.out_proj.weight, self.out_proj.bias, training=False, need_weights=False,
            attn_mask=mask, use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight)
        out = out.transpose(0, 1)  # [batch, seq, E]
        return out if key_mask is None else out.masked_fill(~key_mask[..., None], 0.0)


@dataclass(frozen=True)
class AttentionDef(AttentionArch):
    """One attention layer (service.models.attention) and its torch half
    (service.parallel.model.ModelDef)."""

    @classmethod
    def of(cls, arch: AttentionArch) -> "AttentionDef":
        """The torch half of `arch` (service.models.registry)."""
        return cls(**{f.name: getattr(arch, f.name) for f in fields(arch)})

    def check_world_size(self, world_size: int) -> None:
        seam.refuse_split(self.kind, world_size, self.problems(world_size))

    def init_weights(self, init: str, seed: int) -> seam.DenseWeights:
        return seed_weights(self.embed_dim) if init == "seed" else random_weights(self.embed_dim, seed)

    def dense_module(self) -> nn.Module:
        return DenseAttention(self.embed_dim, self.num_heads)

    def dense_forward(self, module: nn.Module, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                      causal: bool = False) -> torch.Tensor:
        return module(x, key_mask, causal)

    def build(self, group: ParallelGroup, dtype: torch.dtype) -> TensorParallelAttention:
        self.check_world_size(group.world_size)
        return TensorParallelAttention(self.embed_dim, self.num_heads, group, dtype=dtype)
