"""Independent dense reference: torch.nn.MultiheadAttention loaded with the same weights.

Written without service/ (the thing it checks); used by tests/ (through tests/reference.py)
and by bench/. `reference(x, mask, causal)` is the one expected answer of the tests.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import nn

# The served model of the tests' apps (deployments/local.yaml): the notes' seed weights.
EMBED_DIM, NUM_HEADS = 512, 8


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


def reference(x: Any, mask: Any = None, causal: bool = False, *,
              weights: dict[str, torch.Tensor] | None = None, num_heads: int = NUM_HEADS) -> torch.Tensor:
    """What the served model answers for `x`, computed by the dense reference in float32.

    `x`: numpy or torch, [batch, seq, E] or [seq, E] (any float dtype: converted to float32);
    `mask`: None or [batch, seq] with 1 = token, 0 = padding; `causal`: causal attention.
    `weights`: the served weights (default: the notes' seed weights, embed_dim 512), with
    `num_heads` heads.
    """
    xt = x.float() if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x, dtype=np.float32))
    w = seed_weights_512() if weights is None else weights
    if mask is None and not causal:
        return dense_attention(w, num_heads, xt)
    m = None if mask is None else torch.as_tensor(np.asarray(mask, dtype=np.int64))
    return dense_attention_masked(w, num_heads, xt, m, causal)


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


@functools.cache
def seed_weights_512() -> dict[str, torch.Tensor]:
    """notes_seed_weights(512), made once (the reference only reads them)."""
    return notes_seed_weights(EMBED_DIM)
