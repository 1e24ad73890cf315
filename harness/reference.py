"""Independent dense reference: torch.nn.MultiheadAttention loaded with the same weights.

Written without service/ (the thing it checks); used by tests/ (through tests/reference.py)
and by bench/.
"""
from __future__ import annotations

import torch
from torch import nn


def dense_reference(weights: dict[str, torch.Tensor], num_heads: int) -> nn.MultiheadAttention:
    """nn.MultiheadAttention(E, H, bias=True, batch_first=True) with in_proj = cat(q, k, v)."""
    embed_dim = weights["q_proj.weight"].shape[0]
    mha = nn.MultiheadAttention(embed_dim, num_heads, bias=True, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(
            torch.cat([weights["q_proj.weight"], weights["k_proj.weight"], weights["v_proj.weight"]])
        )
        mha.in_proj_bias.copy_(
            torch.cat([weights["q_proj.bias"], weights["k_proj.bias"], weights["v_proj.bias"]])
        )
        mha.out_proj.weight.copy_(weights["out_proj.weight"])
        mha.out_proj.bias.copy_(weights["out_proj.bias"])
    return mha.eval()


def dense_attention(weights: dict[str, torch.Tensor], num_heads: int, x: torch.Tensor) -> torch.Tensor:
    """Self-attention of x ([batch, seq, E] or [seq, E]) through the dense reference."""
    squeeze = x.dim() == 2
    xb = x.unsqueeze(0) if squeeze else x
    with torch.inference_mode():
        out, _ = dense_reference(weights, num_heads)(xb, xb, xb, need_weights=False)
    return out.squeeze(0) if squeeze else out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64."""
    got64, want64 = got.double(), want.double()
    return float((got64 - want64).norm() / want64.norm())


def notes_seed_weights(embed_dim: int) -> dict[str, torch.Tensor]:
    """The original notes' init, written the way the notes write it (independently of service/).

    Each projection: an integer arange copied into a float32 parameter, then `+= offset`.
    """
    weights = {}
    for name, offset in (("q_proj", 0.1), ("k_proj", -0.2), ("v_proj", 0.3), ("out_proj", -0.4)):
        w = torch.empty(embed_dim, embed_dim)
        b = torch.empty(embed_dim)
        with torch.no_grad():
            w.copy_(torch.arange(0, embed_dim * embed_dim).reshape(embed_dim, embed_dim))
            b.copy_(torch.arange(0, embed_dim))
            w += offset
            b += offset
        weights[f"{name}.weight"], weights[f"{name}.bias"] = w, b
    return weights
