"""The dense reference lives in harness/reference.py (shared with bench/); re-exported here
for the tests that import it from tests.reference. Beside it, torch's own nn.TransformerEncoder
built from a TransformerDef (the independent reference of model=transformer, in float64) and
the small stacks the transformer tests share."""
from __future__ import annotations

import torch
from torch import nn

from harness.reference import (
    dense_attention,
    dense_attention_masked,
    dense_reference,
    notes_seed_weights,
    reference,
    relative_error,
)
from service.parallel.transformer import TransformerDef

__all__ = ["STACKS", "TOL", "dense_attention", "dense_attention_masked", "dense_reference", "notes_seed_weights",
           "reference", "relative_error", "torch_encoder", "torch_reference"]


TOL = 1e-5  # float32 against float64 (the parity goal)
STACKS = {
    "post-relu": TransformerDef(3, 64, 8, 96, "relu", False),
    "pre-gelu": TransformerDef(2, 64, 4, 128, "gelu", True, 1e-6),
}


def torch_encoder(arch: TransformerDef, weights: dict[str, torch.Tensor]) -> nn.TransformerEncoder:
    """torch's own stack, built here from the issue's definition, holding `weights` in float64."""
    layer = nn.TransformerEncoderLayer(arch.embed_dim, arch.num_heads, arch.ffn_dim, dropout=0.0,
                                       activation=arch.activation, batch_first=True, norm_first=arch.norm_first,
                                       layer_norm_eps=arch.layer_norm_eps)
    module = nn.TransformerEncoder(layer, arch.num_layers, enable_nested_tensor=False).double().eval()
    module.load_state_dict({k: v.double() for k, v in weights.items()}, strict=True)
    return module


def torch_reference(module: nn.TransformerEncoder, x: torch.Tensor, tokens: torch.Tensor | None,
                    causal: bool) -> torch.Tensor:
    """float64 output of torch's module; rows at padded positions are not compared."""
    seq = x.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool).triu_(1) if causal else None  # True = may not attend
    padding = None if tokens is None else ~tokens
    with torch.no_grad():
        return module(x.double(), mask=mask, src_key_padding_mask=padding, is_causal=causal)
