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


def dense_attention_masked(
    weights: dict[str, torch.Tensor], num_heads: int, x: torch.Tensor,
    attention_mask: torch.Tensor | None = None, causal: bool = False,
) -> torch.Tensor:
    """The masked contract through the dense reference (x [batch, seq, E] or [seq, E]).

    `attention_mask` [batch, seq] (or [seq]): 1 = token, 0 = padding (Hugging Face). Computed
    as nn.MultiheadAttention(x, x, x, key_padding_mask=(mask == 0), attn_mask=<causal>),
    then the output at padded query positions is set to 0 (MHA itself leaves them finite
    or, for a query with no key left, NaN).
    """
    squeeze = x.dim() == 2
    xb = x.unsqueeze(0) if squeeze else x
    seq = xb.shape[1]
    key_padding = None
    if attention_mask is not None:
        mask = attention_mask.reshape(xb.shape[0], seq)
        key_padding = mask == 0  # [batch, seq], True = ignore this key
    attn_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1) if causal else None  # True = ignore
    with torch.inference_mode():
        mha = dense_reference(weights, num_heads).to(xb.dtype)  # float64 x: a float64 reference
        out, _ = mha(xb, xb, xb, key_padding_mask=key_padding, attn_mask=attn_mask, need_weights=False)
        if key_padding is not None:
            out = out.masked_fill(key_padding[..., None], 0.0)
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
