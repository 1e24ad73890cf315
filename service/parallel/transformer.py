"""`model=transformer`: a stack of encoder layers exactly as torch defines them, tensor-parallel.

It computes `nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, ffn_dim, dropout=0,
activation, batch_first=True, norm_first, layer_norm_eps), num_layers)` (no final norm), and
its checkpoint is that module's own `state_dict()` (`layers.{i}.self_attn.in_proj_weight`, ...).

One layer on rank r of p (Megatron's parallel transformer layer), x [batch, seq, E] on every rank:

    qkv_r   = x W_in[r]^T + b_in[r]          W_in[r] = [W_q; W_k; W_v] rows of r's heads: one
                                             fused GEMM [3E/p, E] (COLUMN, 3 blocks)
    ctx_r   = softmax(q_r k_r^T / sqrt(D) + M) v_r           r's H/p heads, no communication
    sa      = all_reduce(ctx_r W_out[:, r]^T) + b_out        ROW: the layer's first all_reduce
    ff      = all_reduce(act(h W_1[r]^T + b_1[r]) W_2[:, r]^T) + b_2
                                             W_1 COLUMN [F/p, E], W_2 ROW [E, F/p]: the second
    norm_first:  x = x + sa(norm1(x));  x = x + ff(norm2(x))
    otherwise:   x = norm1(x + sa(x));  x = norm2(x + ff(x))

The norms and the biases of the ROW layers are replicated; two all_reduces per layer and
nothing else crosses ranks. Output rows at padded query positions are 0.

A rank that holds the whole layer (world size 1) runs each layer as torch's own fused encoder
kernel, `torch._transformer_encoder_layer_fwd` (the fast path `nn.TransformerEncoderLayer`
takes in inference mode: one call per layer for the QKV GEMM, the bias/rescale/head split,
attention, the out projection, both norms and the MLP), whenever that fast path's conditions
hold (`FusedEncoder`); otherwise, and on every rank of a larger gang, op by op as above. The
kernel takes no share of a layer: it checks that its embed_dim is the input's width (a rank's
heads are E/p wide) and applies the norms, which need the all_reduced sum, inside the call.

Sessions (`append`): each layer caches its own K/V of its own input rows (pool layer i), so an
appended row runs every layer over its session's cached positions (service.parallel.kv_cache).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, Mapping

import torch
from torch import nn

import service.parallel.model as seam
from service.models.transformer import TransformerArch
from service.parallel.linear import Activation, RowNorm, linear, prenormed
from service.parallel.group import ParallelGroup
from service.parallel.kv_cache import AppendPlan, PagedKVPool, paged_attention
from service.parallel.layers import ColumnParallelLinear, RowParallelLinear, attention_bias_mask, head_attention

ACTIVATIONS: dict[str, Activation] = {"relu": "relu", "gelu": "gelu"}  # ARCH's names -> linear's epilogue


class _ParallelSelfAttention(nn.Module):
    """Rank r's heads of one layer's self-attention; parameter names as torch's
    nn.MultiheadAttention's (`in_proj_weight`, `in_proj_bias`, `out_proj.*`), r's slices."""

    def __init__(self, embed_dim: int, num_heads: int, group: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads_local = num_heads // group.world_size
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim ** -0.5
        width = self.heads_local * self.head_dim  # E / p
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, embed_dim, dtype=dtype, device=group.device),
                                           requires_grad=False)
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width, dtype=dtype, device=group.device), requires_grad=False)
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, group, dtype=dtype)

    def qkv(self, x: torch.Tensor, norm: RowNorm | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., E] -> q, k, v [..., h_l, d] of norm(x) (one fused GEMM; `norm` None: x as it is)."""
        qkv = linear(x, self.in_proj_weight, self.in_proj_bias, norm=norm)  # [..., 3 * h_l * d]
        q, k, v = qkv.view(*x.shape[:-1], 3, self.heads_local, self.head_dim).unbind(-3)
        return q, k, v

    def context(self, x: torch.Tensor, key_mask: torch.Tensor | None, causal: bool,
                norm: RowNorm | None = None) -> torch.Tensor:
        """x [batch, seq, E] -> this rank's attention context [batch, seq, E/p] over norm(x) (no collective)."""
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x, norm))  # [batch, h_l, seq, d] each
        return head_attention(q, k, v, key_mask, causal, self.scale)


class ParallelEncoderLayer(nn.Module):
    """Rank r's shard of one `nn.TransformerEncoderLayer` (module docstring)."""

    def __init__(self, spec: "TransformerDef", group: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        e = spec.embed_dim
        self.norm_first = spec.norm_first
        self.activation = ACTIVATIONS[spec.activation]  # applied by linear1's kernel (linear's epilogue)
        self.self_attn = _ParallelSelfAttention(e, spec.num_heads, group, dtype)
        self.linear1 = ColumnParallelLinear(e, spec.ffn_dim, group, dtype=dtype)
        self.linear2 = RowParallelLinear(spec.ffn_dim, e, group, dtype=dtype)
        self.norm1 = nn.LayerNorm(e, eps=spec.layer_norm_eps, dtype=dtype, device=group.device)
        self.norm2 = nn.LayerNorm(e, eps=spec.layer_norm_eps, dtype=dtype, device=group.device)
        for p in (*self.norm1.parameters(), *self.norm2.parameters()):
            p.requires_grad_(False)

    def _ff(self, h: torch.Tensor, norm: RowNorm | None = None) -> torch.Tensor:
        return self.linear2(self.linear1(h, self.activation, norm))  # [..., E], all-reduced

    @staticmethod
    def _row_norm(norm: nn.LayerNorm) -> RowNorm:
        return RowNorm("layer", norm.weight, norm.bias, norm.eps)

    def _residual(self, x: torch.Tensor, sa: Callable[[torch.Tensor, RowNorm | None], torch.Tensor]) -> torch.Tensor:
        """The layer around its attention `sa` (input rows and the norm still to apply to them, or
        None -> all-reduced [.., E]). Pre-norm: where the few-row kernel computes the matmul that
        reads a norm's output, it applies the norm too (linear.prenormed), else it is applied here."""
        if self.norm_first:
            h, norm = prenormed(x, self._row_norm(self.norm1), self.self_attn.in_proj_weight)
            x = x + sa(h, norm)
            h, norm = prenormed(x, self._row_norm(self.norm2), self.linear1.weight)
            return x + self._ff(h, norm)
        x = self.norm1(x + sa(x, None))
        return self.norm2(x + self._ff(x))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        return self._residual(x, lambda h, norm: self.self_attn.out_proj(
            self.self_attn.context(h, key_mask, causal, norm)))

    def append(self, x: torch.Tensor, plan: AppendPlan, pool: PagedKVPool, layer: int) -> torch.Tensor:
        """x [T, E], the new rows' input to this layer -> its output [T, E] (sessions)."""
        def sa(h: torch.Tensor, norm: RowNorm | None) -> torch.Tensor:
            q, k, v = self.self_attn.qkv(h, norm)  # [T, h_l, d] each
            ctx = paged_attention(pool, layer, q, k, v, plan, self.self_attn.scale)  # [T, h_l, d]
            return self.self_attn.out_proj(ctx.reshape(x.shape[0], -1))  # [T, E], all-reduced
        return self._residual(x, sa)

    def fused(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The whole layer as torch's fused encoder kernel (world size 1 only: `FusedEncoder`):
        x [batch, seq, E] -> [batch, seq, E]; `bias` [batch, seq], 0 at tokens and -inf at
        padded keys (torch's key padding mask, mask type 1), or None."""
        attn = self.self_attn
        return torch._transformer_encoder_layer_fwd(
            x, attn.heads_local * attn.head_dim, attn.heads_local, attn.in_proj_weight, attn.in_proj_bias,
            attn.out_proj.weight, attn.out_proj.bias, self.activation == "gelu", self.norm_first, self.norm1.eps,
            self.norm1.weight, self.norm1.bias, self.norm2.weight, self.norm2.bias, self.linear1.weight,
            self.linear1.bias, self.linear2.weight, self.linear2.bias, bias,
            None if bias is None else 1)


@dataclass(frozen=True)
class FusedEncoder:
    """When a rank's stack runs torch's fused encoder kernel (`ParallelEncoderLayer.fused`): the
    conditions of `nn.TransformerEncoderLayer`'s own fast path (torch/nn/modules/transformer.py)
    that our layers can meet, plus ours.

    Fixed when the stack is built: the rank holds whole layers (world size 1), an even head count
    (torch's condition), equal norm eps (ours are), relu or gelu (ours are), a CPU or CUDA device.
    Per call (`applies`): the input is [batch, seq, E], torch's fast path is enabled
    (`torch.backends.mha.get_fastpath_enabled()`, so it can be switched off to compare), no
    autograd (the kernel has no backward: the rank runs in inference mode), no autocast, and not
    causal: the op-by-op path keeps causal requests, whose padded queries must attend every key
    (`attention_bias_mask`) where torch's mask would leave a left-padded query no key at all.
    A key padding mask alone is the kernel's mask type 1 (a padded query then attends the
    row's tokens, as `sdpa_mask` lets it; its output row is set to 0 afterwards)."""

    whole_layers: bool

    @classmethod
    def of(cls, spec: "TransformerDef", group: ParallelGroup) -> "FusedEncoder":
        return cls(group.world_size == 1 and spec.num_heads % 2 == 0 and group.device.type in ("cpu", "cuda"))

    def applies(self, x: torch.Tensor, causal: bool) -> bool:
        return (self.whole_layers and not causal and x.dim() == 3 and torch.backends.mha.get_fastpath_enabled()
                and not torch.is_grad_enabled() and not torch.is_autocast_enabled())


def padding_bias(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """key_mask [batch, seq] bool (True = token) -> [batch, seq] in `dtype`: 0 at tokens, -inf at
    padding (what torch's layer hands its fused kernel for a `src_key_padding_mask`)."""
    return torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device).masked_fill_(~key_mask, float("-inf"))


class ParallelEncoder(nn.Module):
    """Rank r's shard of the whole stack (a service.parallel.model.RankModel)."""

    def __init__(self, spec: "TransformerDef", group: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ParallelEncoderLayer(spec, group, dtype) for _ in range(spec.num_layers))
        self.fused_path = FusedEncoder.of(spec, group)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        if self.fused_path.applies(x, causal):
            bias = None if key_mask is None else padding_bias(key_mask, x.dtype)
            for layer in self.layers:
                x = layer.fused(x, bias)  # [batch, seq, E]
        else:
            for layer in self.layers:
                x = layer(x, key_mask, causal)  # [batch, seq, E]
        if key_mask is not None:
            x = x.masked_fill(~key_mask[..., None], 0.0)  # padded query positions have no output
        return x

    def warm_local(self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        """Layer 0's local kernels (attention and the MLP's GEMMs), partial sums, no collective;
        at world size 1 where the fused kernel applies, layer 0 through it (what a step runs)."""
        layer = self.layers[0]
        if self.fused_path.applies(x, causal):
            return layer.fused(x, None if key_mask is None else padding_bias(key_mask, x.dtype))
        attn = layer.self_attn
        ctx = attn.context(layer.norm1(x), key_mask, causal)
        return linear(ctx, attn.out_proj.weight) + linear(layer.linear1(x, layer.activation), layer.linear2.weight)

    def append(self, x: torch.Tensor, plan: AppendPlan, pool: PagedKVPool) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer.append(x, plan, pool, i)  # [T, E]
        return x

    def load_shard(self, shard: Mapping[str, torch.Tensor]) -> None:
        seam.load_shard_into(self, shard)

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


@dataclass(frozen=True)
class TransformerDef(TransformerArch):
    """The stack's architecture (service.models.transformer) and its torch half
    (service.parallel.model.ModelDef)."""

    @classmethod
    def of(cls, arch: TransformerArch) -> "TransformerDef":
        """The torch half of `arch` (service.models.registry)."""
        return cls(**{f.name: getattr(arch, f.name) for f in fields(arch)})

    def check_world_size(self, world_size: int) -> None:
        seam.refuse_split(self.kind, world_size, self.problems(world_size))

    def init_weights(self, init: str, seed: int) -> seam.DenseWeights:
        """Reproducible from `seed` alone (`init` seed and random alike: the notes' weights are
        the attention layer's): every Linear weight and bias U(+-1/sqrt(fan_in)), norms 1 and 0,
        drawn in `params()` order from one generator."""
        gen = torch.Generator().manual_seed(seed)
        weights: seam.DenseWeights = {}
        fan_in = self.embed_dim
        for spec in self.params():
            if ".norm" in spec.name:
                weights[spec.name] = torch.ones(spec.shape) if spec.name.endswith("weight") else torch.zeros(spec.shape)
                continue
            if len(spec.shape) == 2:
                fan_in = spec.shape[1]
            bound = 1 / math.sqrt(fan_in)
            weights[spec.name] = (torch.rand(spec.shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound
        return weights

    def dense_module(self) -> nn.TransformerEncoder:
        layer = nn.TransformerEncoderLayer(self.embed_dim, self.num_heads, self.ffn_dim, dropout=0.0,
                                           activation=self.activation, batch_first=True, norm_first=self.norm_first,
                                           layer_norm_eps=self.layer_norm_eps)
        return nn.TransformerEncoder(layer, self.num_layers, enable_nested_tensor=False)

    def dense_forward(self, module: nn.Module, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                      causal: bool = False) -> torch.Tensor:
        assert isinstance(module, nn.TransformerEncoder)
        return encoder_forward(module, self.num_heads, x, key_mask, causal)

    def build(self, group: ParallelGroup, dtype: torch.dtype) -> ParallelEncoder:
        self.check_world_size(group.world_size)
        return ParallelEncoder(self, group, dtype)


def encoder_forward(module: nn.TransformerEncoder, num_heads: int, x: torch.Tensor,
                    key_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """The dense stack under the service's contract (training's forward): padded keys ignored,
    with `causal` query i sees keys j <= i, output rows at padded positions 0.

    The mask torch gets lets a padded query attend every key (attention_bias_mask) instead of
    none: with causal and left padding a padded row would otherwise be all -inf, NaN, and the
    next layer would read that NaN as a value (0 * NaN in softmax @ V) in every row."""
    if key_mask is None:
        if not causal:
            return module(x)
        seq = x.shape[1]
        blocked = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu_(1)  # j > i
        return module(x, mask=blocked, is_causal=True)
    batch, seq = key_mask.shape
    allowed = attention_bias_mask(key_mask, causal)  # [batch, 1, seq, seq], True = attend
    blocked = ~allowed.expand(batch, num_heads, seq, seq).reshape(batch * num_heads, seq, seq)
    return module(x, mask=blocked).masked_fill(~key_mask[..., None], 0.0)

