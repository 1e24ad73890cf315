"""The trainable models and their checkpoint files (torch only, no Ray).

attention: `SelfAttention` wraps nn.MultiheadAttention(E, H, bias=True, batch_first=True);
its in_proj is cat(q, k, v), so the dense contract keys map onto it exactly:
    q_proj.weight = in_proj_weight[0:E],  k_proj = [E:2E],  v_proj = [2E:3E]   (same for bias)
    out_proj.{weight,bias} = out_proj.{weight,bias}
transformer, llama, a user's factory: `DenseModel` wraps the kind's dense module (its
ModelDef's `dense_module()`: torch's nn.TransformerEncoder for a transformer, the module a gang
of the same architecture computes); its checkpoint is that inner module's own `state_dict()`
(no wrapper prefix), written by service.parallel.model.save_checkpoint with the architecture's
metadata, so it loads into torch's (or Hugging Face's) module with `load_state_dict(strict=True)`.
linear: nn.Linear(in, out); checkpoint keys `weight` [out, in], `bias` [out].
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import service.parallel.model as seam
from service.parallel.layers import attention_bias_mask
from service.parallel.weights import DenseWeights, random_weights, save_checkpoint
from service.parallel.registry import resolve
from service.training.spec import AttentionModel, ModelSpecT, RegisteredModel, TransformerModel


class SelfAttention(nn.Module):
    """x [batch, seq, E] (+ attention_mask [batch, seq], 1 = token) -> self-attention(x) [batch, seq, E].

    The function the gang serves: padded keys ignored, with `causal` query i attends keys
    j <= i, output 0 at padded query positions. The mask handed to nn.MultiheadAttention is
    the serving layer's (service.parallel.layers.attention_bias_mask), so a padded query row
    keeps every key instead of none: with left padding and causal it would otherwise be
    all -inf, NaN in the forward and NaN gradients in the backward, even though its output
    is discarded.
    """

    def __init__(self, embed_dim: int, num_heads: int, causal: bool = False) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(embed_dim, num_heads, bias=True, batch_first=True)
        self.causal = causal

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            if not self.causal:
                out, _ = self.mha(x, x, x, need_weights=False)
                return out
            seq = x.shape[1]
            blocked = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu_(1)  # [seq, seq], j > i
            out, _ = self.mha(x, x, x, attn_mask=blocked, is_causal=True, need_weights=False)
            return out
        tokens = attention_mask.to(torch.bool)  # [batch, seq]
        allowed = attention_bias_mask(tokens, self.causal)  # [batch, 1, seq, seq], True = attend
        batch, seq = tokens.shape
        heads = self.mha.num_heads
        blocked = ~allowed.expand(batch, heads, seq, seq).reshape(batch * heads, seq, seq)  # MHA: True = blocked
        out, _ = self.mha(x, x, x, attn_mask=blocked, need_weights=False)
        return out.masked_fill(~tokens[..., None], 0.0)  # [batch, seq, E]


class DenseModel(nn.Module):
    """A served kind's dense module (its ModelDef's `dense_module()`, what a gang of that
    architecture computes: torch's nn.TransformerEncoder for a transformer, the stack for a
    llama, a user's module), under the serving contract (`dense_forward`: padded keys ignored,
    rows at padded positions 0, a padded row never left without keys, so no NaN reaches the
    backward; causal as the spec says or as the model declares). `module` is the kind's own
    module: the checkpoint is its `state_dict()` (no wrapper prefix) with the kind's metadata."""

    def __init__(self, spec: TransformerModel | RegisteredModel) -> None:
        super().__init__()
        self.arch = resolve(spec)  # its kind's torch half (service.parallel.registry)
        self.module = self.arch.dense_module()
        self.causal = spec.causal or seam.is_causal_only(self.arch)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = None if attention_mask is None else attention_mask.to(torch.bool)
        return self.arch.dense_forward(self.module, x, mask, self.causal)

    def load_dense(self, weights: DenseWeights) -> None:
        """Every tensor named and shaped as the kind's params() (ValueError listing each difference), strict."""
        seam.validate_dense(self.arch, weights, what="the checkpoint's tensors")
        self.module.load_state_dict({k: v.to(torch.float32) for k, v in weights.items()}, strict=True)

    def dense(self) -> DenseWeights:
        return seam.dense_state(self.arch, self.module)


def build_model(spec: ModelSpecT, seed: int) -> nn.Module:
    """A freshly initialised student: torch's default init under `seed`; a transformer
    TransformerDef.init_weights("random", seed) (torch's TransformerEncoder deep-copies one
    layer, so its own init would start every layer equal)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(spec, AttentionModel):
            return SelfAttention(spec.embed_dim, spec.num_heads, spec.causal)
        if isinstance(spec, (TransformerModel, RegisteredModel)):
            model = DenseModel(spec)
            model.load_dense(model.arch.init_weights("random", seed))
            return model
        return nn.Linear(spec.in_features, spec.out_features)


def teacher_model(spec: ModelSpecT, seed: int) -> nn.Module:
    """The fixed random teacher that labels synthetic data (same kind as the student).

    attention: the serving stack's `random_weights(E, seed)` (U(+-1/sqrt(E))), causal as the student;
    transformer: the serving stack's TransformerDef.init_weights("random", seed), causal as the student;
    linear: weights and bias ~ N(0, 1), so the targets have unit-scale signal.
    """
    gen = torch.Generator().manual_seed(seed)
    if isinstance(spec, AttentionModel):
        model = SelfAttention(spec.embed_dim, spec.num_heads, spec.causal)
        load_dense_into(model, random_weights(spec.embed_dim, seed))
        return model.eval()
    if isinstance(spec, (TransformerModel, RegisteredModel)):
        return build_model(spec, seed).eval()
    model = nn.Linear(spec.in_features, spec.out_features)
    with torch.no_grad():
        model.weight.copy_(torch.randn(spec.out_features, spec.in_features, generator=gen))
        model.bias.copy_(torch.randn(spec.out_features, generator=gen))
    return model.eval()


def dense_weights(model: SelfAttention) -> DenseWeights:
    """The contract's dense keys from a SelfAttention (in_proj split into q/k/v)."""
    mha = model.mha
    e = mha.embed_dim
    w, b = mha.in_proj_weight.detach(), mha.in_proj_bias.detach()
    return {
        "q_proj.weight": w[0:e], "q_proj.bias": b[0:e],
        "k_proj.weight": w[e:2 * e], "k_proj.bias": b[e:2 * e],
        "v_proj.weight": w[2 * e:3 * e], "v_proj.bias": b[2 * e:3 * e],
        "out_proj.weight": mha.out_proj.weight.detach(), "out_proj.bias": mha.out_proj.bias.detach(),
    }


def load_dense_into(model: SelfAttention, weights: DenseWeights) -> None:
    mha = model.mha
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([weights[f"{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]))
        mha.in_proj_bias.copy_(torch.cat([weights[f"{p}.bias"] for p in ("q_proj", "k_proj", "v_proj")]))
        mha.out_proj.weight.copy_(weights["out_proj.weight"])
        mha.out_proj.bias.copy_(weights["out_proj.bias"])


def save_model(model: nn.Module, spec: ModelSpecT, path: str | Path) -> None:
    """attention: the dense serving checkpoint (service.parallel.weights.save_checkpoint),
    recording `causal`; transformer: the inner nn.TransformerEncoder's state_dict with the
    architecture's metadata and `causal` (service.parallel.model.save_checkpoint); linear:
    `weight`, `bias` with metadata in_features / out_features."""
    if isinstance(spec, AttentionModel):
        assert isinstance(model, SelfAttention)
        save_checkpoint(path, dense_weights(model), spec.num_heads, causal=spec.causal)
        return
    if isinstance(spec, (TransformerModel, RegisteredModel)):
        assert isinstance(model, DenseModel)
        seam.save_checkpoint(model.arch, path, model.dense(), {"causal": "true" if model.causal else "false"})
        return
    assert isinstance(model, nn.Linear)
    save_file(
        {"weight": model.weight.detach().contiguous().cpu(), "bias": model.bias.detach().contiguous().cpu()},
        str(path),
        metadata={"kind": "linear", "in_features": str(spec.in_features), "out_features": str(spec.out_features)},
    )


def load_model(model: nn.Module, spec: ModelSpecT, path: str | Path) -> None:
    """Inverse of save_model (used when a run resumes from a checkpoint)."""
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    load_tensors(model, spec, tensors)


def load_tensors(model: nn.Module, spec: ModelSpecT, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a checkpoint's tensors (save_model's keys) into `model`; a missing key or a
    tensor of another shape raises (KeyError / RuntimeError naming it)."""
    if isinstance(spec, AttentionModel):
        assert isinstance(model, SelfAttention)
        load_dense_into(model, tensors)
    elif isinstance(spec, (TransformerModel, RegisteredModel)):
        assert isinstance(model, DenseModel)
        model.load_dense(tensors)
    else:
        model.load_state_dict(tensors)
