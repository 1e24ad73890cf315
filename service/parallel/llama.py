"""`model=llama`: a Llama-family decoder stack (Llama, Mistral without sliding windows), tensor-parallel.

It computes exactly `transformers.LlamaModel(config)(inputs_embeds=x).last_hidden_state` with
each sequence's real rows at positions 0, 1, ... (left or right padding alike): hidden states in,
hidden states out (no `embed_tokens` lookup, no `lm_head`). Its checkpoint is a Hugging Face
`save_pretrained` directory (service.parallel.model.open_checkpoint), its architecture that
directory's config.json (service.models.llama). The model is causal by declaration.

One block on rank r of p, x [batch, seq, E] on every rank, positions t of the real rows:

    h       = rmsnorm(x) * w_in                      rmsnorm(x) = x / sqrt(mean(x^2) + eps), in float32
    q_r     = rope(h Wq[r]^T, t)                     r's H/p query heads (COLUMN by head)
    k_r,v_r = rope(h Wk[r]^T, t), h Wv[r]^T          r's K/V heads: KV/p of them, or, with fewer
                                                     K/V heads than ranks, head r*KV // p (each
                                                     held by p/KV ranks: vLLM's replicas)
    ctx_r   = softmax(q_r k_r^T / sqrt(d) + causal) v_r   query head i reads K/V head i // (H/KV)
    x       = x + all_reduce(ctx_r Wo[:, r]^T)       ROW: the block's first all_reduce
    h       = rmsnorm(x) * w_post
    x       = x + all_reduce((silu(h Wg[r]^T) * h Wu[r]^T) Wd[:, r]^T)   gate/up COLUMN, down ROW
    out     = rmsnorm(x) * w_norm                    after the last block

    rope(y, t) = y cos(t f) + rotate_half(y) sin(t f), f = the config's inverse frequencies
    (`default`: theta^(-2i/d); `llama3`: those rescaled by band), rotate_half([a, b]) = [-b, a].

Two all_reduces per block and nothing else crosses ranks. Output rows at padded positions are 0.
Sessions (`append`): each block caches its rotated K and its V (pool layer i) of the session's
rows at their positions c_i + j, so an appended row continues from the session's length.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

import service.parallel.model as seam
from service.parallel.linear import Rotary, RowNorm, apply_rotary, linear, prenormed
from service.parallel.group import ParallelGroup
from service.parallel.kv_cache import AppendPlan, PagedKVPool, paged_attention
from service.parallel.layers import head_attention
from service.models.llama import LlamaArchitecture

log = logging.getLogger(__name__)


# -- the math both halves share (the dense module and a rank's shard) -------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), the statistics in float32 (as LlamaRMSNorm)."""
    return RowNorm("rms", weight, None, eps).apply(x)


def inverse_frequencies(arch: LlamaArchitecture) -> torch.Tensor:
    """[d/2] float32: theta^(-2i/d), rescaled by the llama3 bands when the config says so."""
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))
    rope = arch.rope_llama3
    if rope is None:
        return inv
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., d] of integer `positions` [...]: angles t * f in float32, then `dtype`."""
    freqs = positions[..., None].to(torch.float32) * inv_freq.to(positions.device)  # [..., d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotated_qkv(attn: nn.Module, h: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [..., E] -> q [..., heads, d], k, v [..., kv_heads, d] through `attn`'s q/k/v projections,
    q and k rotated (cos, sin [..., 1, d]: the same angles for every head)."""
    q = apply_rotary(attn.q_proj(h).unflatten(-1, (heads, head_dim)), cos, sin)
    k = apply_rotary(attn.k_proj(h).unflatten(-1, (kv_heads, head_dim)), cos, sin)
    return q, k, attn.v_proj(h).unflatten(-1, (kv_heads, head_dim))


def row_positions(key_mask: torch.Tensor | None, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """[batch, seq] int64: each real row's position among its sequence's real rows (0, 1, ...),
    so left and right padding give the same positions; padded rows get the position before them
    (their output is discarded)."""
    if key_mask is None:
        return torch.arange(seq, device=device).expand(batch, seq)
    return (key_mask.to(torch.int64).cumsum(-1) - 1).clamp_(min=0)


# -- the dense reference (training trains it; Hugging Face's names) ----------------------------
class _DenseAttention(nn.Module):
    def __init__(self, arch: LlamaArchitecture) -> None:
        super().__init__()
        e, d, b = arch.hidden_size, arch.head_dim, arch.attention_bias
        self.q_proj = nn.Linear(e, arch.num_heads * d, bias=b)
        self.k_proj = nn.Linear(e, arch.num_kv_heads * d, bias=b)
        self.v_proj = nn.Linear(e, arch.num_kv_heads * d, bias=b)
        self.o_proj = nn.Linear(arch.num_heads * d, e, bias=b)


class _DenseMLP(nn.Module):
    def __init__(self, arch: LlamaArchitecture) -> None:
        super().__init__()
        e, i, b = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        self.gate_proj = nn.Linear(e, i, bias=b)
        self.up_proj = nn.Linear(e, i, bias=b)
        self.down_proj = nn.Linear(i, e, bias=b)


class _Norm(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device))


class _DenseBlock(nn.Module):
    def __init__(self, arch: LlamaArchitecture) -> None:
        super().__init__()
        self.self_attn = _DenseAttention(arch)
        self.mlp = _DenseMLP(arch)
        self.input_layernorm = _Norm(arch.hidden_size)
        self.post_attention_layernorm = _Norm(arch.hidden_size)


class DenseLlama(nn.Module):
    """The whole stack on one device; `state_dict()` has LlamaModel's names without `embed_tokens`.
    forward(x [batch, seq, E], key_mask [batch, seq] bool | None) -> [batch, seq, E] (module docstring)."""

    def __init__(self, arch: LlamaArchitecture) -> None:
        super().__init__()
        self.arch = arch
        self.layers = nn.ModuleList(_DenseBlock(arch) for _ in range(arch.num_layers))
        self.norm = _Norm(arch.hidden_size)
        self.register_buffer("inv_freq", inverse_frequencies(arch), persistent=False)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        a = self.arch
        batch, seq, _ = x.shape
        cos, sin = rotary(row_positions(key_mask, batch, seq, x.device), self.inv_freq, x.dtype)  # [b, s, d]
        cos, sin = cos[:, :, None], sin[:, :, None]  # [b, s, 1, d]: every head
        for block in self.layers:
            attn, mlp = block.self_attn, block.mlp
            h = rms_norm(x, block.input_layernorm.weight, a.rms_norm_eps)
            q, k, v = (t.transpose(1, 2) for t in rotated_qkv(attn, h, a.num_heads, a.num_kv_heads, a.head_dim,
                                                               cos, sin))  # [b, heads, s, d]
            x = x + attn.o_proj(head_attention(q, k, v, key_mask, True, a.head_dim ** -0.5))
            h = rms_norm(x, block.post_attention_layernorm.weight, a.rms_norm_eps)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        x = rms_norm(x, self.norm.weight, a.rms_norm_eps)
        return x if key_mask is None else x.masked_fill(~key_mask[..., None], 0.0)


# -- a rank's shard -----------------------------------------------------------------------------
class _Slice(nn.Module):
    """A rank's slice of one Linear ([rows, cols] weight, an optional bias), frozen."""

    def __init__(self, rows: int, cols: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype, device=device), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, norm: RowNorm | None = None, rotary: Rotary | None = None) -> torch.Tensor:
        """rotary(norm(x) W^T + b) (None: none; the few-row kernel applies them to its rows)."""
        return linear(x, self.weight, self.bias, norm=norm, rotary=rotary)


class _RankAttention(nn.Module):
    def __init__(self, arch: LlamaArchitecture, group: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        p, d, e, dev = group.world_size, arch.head_dim, arch.hidden_size, group.device
        self.heads = arch.num_heads // p
        self.kv_heads = max(arch.num_kv_heads // p, 1)
        self.q_proj = _Slice(self.heads * d, e, arch.attention_bias, dtype, dev)
        self.k_proj = _Slice(self.kv_heads * d, e, arch.attention_bias, dtype, dev)
        self.v_proj = _Slice(self.kv_heads * d, e, arch.attention_bias, dtype, dev)
        self.o_proj = _Slice(e, self.heads * d, arch.attention_bias, dtype, dev)  # ROW: bias after the reduce


class _RankMLP(nn.Module):
    def __init__(self, arch: LlamaArchitecture, group: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        e, i, dev = arch.hidden_size, arch.intermediate_size // group.world_size, group.device
        self.gate_proj = _Slice(i, e, arch.mlp_bias, dtype, dev)
        self.up_proj = _Slice(i, e, arch.mlp_bias, dtype, dev)
        self.down_proj = _Slice(e, i, arch.mlp_bias, dtype, dev)  # ROW


class _RankBlock(nn.Module):
    def __init__(self, arch: LlamaArchitecture, group: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = _RankAttention(arch, group, dtype)
        self.mlp = _RankMLP(arch, group, dtype)
        self.input_layernorm = _Norm(arch.hidden_size, dtype, group.device)
        self.post_attention_layernorm = _Norm(arch.hidden_size, dtype, group.device)
        for norm in (self.input_layernorm, self.post_attention_layernorm):
            norm.weight.requires_grad_(False)


class LlamaShard(nn.Module):
    """Rank r's shard of the stack (a service.parallel.model.RankModel; module docstring)."""

    def __init__(self, arch: LlamaArchitecture, group: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch, self.group = arch, group
        self.layers = nn.ModuleList(_RankBlock(arch, group, dtype) for _ in range(arch.num_layers))
        self.norm = _Norm(arch.hidden_size, dtype, group.device)
        self.norm.weight.requires_grad_(False)
        self.register_buffer("inv_freq", inverse_frequencies(arch).to(group.device), persistent=False)
        self.scale = arch.head_dim ** -0.5

    def _reduce(self, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A ROW layer's all_reduce of the ranks' partial products, then its bias once."""
        self.group.all_reduce_(partial)
        return partial if bias is None else partial.add_(bias)

    def _norm(self, norm: nn.Module) -> RowNorm:
        return RowNorm("rms", norm.weight, None, self.arch.rms_norm_eps)

    def _mlp(self, block: _RankBlock, x: torch.Tensor) -> torch.Tensor:
        """x + the block's MLP over rmsnorm(x) (its all_reduce)."""
        mlp = block.mlp
        h, norm = prenormed(x, self._norm(block.post_attention_layernorm), mlp.gate_proj.weight)
        partial = linear(F.silu(mlp.gate_proj(h, norm)) * mlp.up_proj(h, norm), mlp.down_proj.weight)
        return x + self._reduce(partial, mlp.down_proj.bias)

    def _qkv(self, block: _RankBlock, x: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's q, k, v of rmsnorm(x) [..., h_l / kv_l, d], q and k rotated (cos, sin
        [..., 1, d]): rotated_qkv's math, with the norm and the rotation handed to the matmuls."""
        attn, d = block.self_attn, self.arch.head_dim
        h, norm = prenormed(x, self._norm(block.input_layernorm), attn.q_proj.weight)
        rotary = Rotary(cos, sin, d)
        return (attn.q_proj(h, norm, rotary).unflatten(-1, (attn.heads, d)),
                attn.k_proj(h, norm, rotary).unflatten(-1, (attn.kv_heads, d)),
                attn.v_proj(h, norm).unflatten(-1, (attn.kv_heads, d)))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        """x [batch, seq, E] -> [batch, seq, E], all-reduced. Always causal (the model declares
        itself causal: the gang refuses a request for bidirectional attention before it gets here)."""
        a = self.arch
        batch, seq, _ = x.shape
        cos, sin = rotary(row_positions(key_mask, batch, seq, x.device), self.inv_freq, x.dtype)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [b, s, 1, d]
        for block in self.layers:
            attn = block.self_attn
            q, k, v = (t.transpose(1, 2) for t in self._qkv(block, x, cos, sin))  # [b, h_l / kv_l, s, d]
            ctx = head_attention(q, k, v, key_mask, True, self.scale)  # [b, s, h_l * d]
            x = x + self._reduce(linear(ctx, attn.o_proj.weight), attn.o_proj.bias)
            x = self._mlp(block, x)
        x = rms_norm(x, self.norm.weight, a.rms_norm_eps)
        return x if key_mask is None else x.masked_fill(~key_mask[..., None], 0.0)

    def warm_local(self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
        """Block 0's local kernels (attention and the MLP's GEMMs), partial sums, no collective."""
        a, block = self.arch, self.layers[0]
        attn, mlp = block.self_attn, block.mlp
        batch, seq, _ = x.shape
        cos, sin = rotary(row_positions(key_mask, batch, seq, x.device), self.inv_freq, x.dtype)
        h = rms_norm(x, block.input_layernorm.weight, a.rms_norm_eps)
        q, k, v = (t.transpose(1, 2) for t in rotated_qkv(attn, h, attn.heads, attn.kv_heads, a.head_dim,
                                                           cos[:, :, None], sin[:, :, None]))
        ctx = head_attention(q, k, v, key_mask, True, self.scale)
        return linear(ctx, attn.o_proj.weight) + linear(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h),
                                                            mlp.down_proj.weight)

    def append(self, x: torch.Tensor, plan: AppendPlan, pool: PagedKVPool) -> torch.Tensor:
        """A session step: x [T, E] the plan's new rows, at positions c_i + j -> [T, E] (sessions)."""
        a = self.arch
        rows = x.shape[0]
        positions = torch.from_numpy(plan.positions()).to(x.device)
        cos, sin = rotary(positions, self.inv_freq, x.dtype)  # [T, d]
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, d]
        for i, block in enumerate(self.layers):
            attn = block.self_attn
            q, k, v = self._qkv(block, x, cos, sin)  # [T, h_l / kv_l, d]
            ctx = paged_attention(pool, i, q, k, v, plan, self.scale)  # [T, h_l, d]
            x = x + self._reduce(linear(ctx.reshape(rows, -1), attn.o_proj.weight), attn.o_proj.bias)
            x = self._mlp(block, x)
        return rms_norm(x, self.norm.weight, a.rms_norm_eps)

    def load_shard(self, shard: Mapping[str, torch.Tensor]) -> None:
        seam.load_shard_into(self, shard)

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


# -- the architecture (service.parallel.model.ModelDef) ----------------------------------------
@dataclass(frozen=True)
class LlamaDef:
    """`model=llama` (module docstring): the architecture of a config.json, and the directory
    its weights come from (None: `init` makes them)."""

    arch: LlamaArchitecture
    kind: str = "llama"
    causal_only: bool = True
    # LlamaForCausalLM's token embedding and head: hidden states in, hidden states out.
    ignored_weights: tuple[str, ...] = ("embed_tokens.", "lm_head.")

    @classmethod
    def of(cls, arch: LlamaArchitecture) -> "LlamaDef":
        """The torch half of `arch` (service.models.registry)."""
        return cls(arch)

    @classmethod
    def from_directory(cls, directory: str | Path) -> "LlamaDef":
        return cls(LlamaArchitecture.read(directory))

    @property
    def embed_dim(self) -> int:
        return self.arch.hidden_size

    @property
    def kv_layers(self) -> int:
        return self.arch.num_layers

    @property
    def kv_heads(self) -> int:
        return self.arch.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.arch.head_dim

    def params(self) -> tuple[seam.ParamSpec, ...]:
        return self.arch.params()

    def check_world_size(self, world_size: int) -> None:
        seam.refuse_split(self.kind, world_size, self.arch.problems(world_size))

    def init_weights(self, init: str, seed: int) -> seam.DenseWeights:
        """Reproducible from `seed` (Hugging Face's init): Linear weights N(0, 0.02), biases 0,
        norms 1, drawn in `params()` order from one generator."""
        gen = torch.Generator().manual_seed(seed)
        weights: seam.DenseWeights = {}
        for spec in self.params():
            if spec.name.endswith("norm.weight"):
                weights[spec.name] = torch.ones(spec.shape)
            elif spec.name.endswith(".bias"):
                weights[spec.name] = torch.zeros(spec.shape)
            else:
                weights[spec.name] = torch.randn(spec.shape, generator=gen, dtype=torch.float32) * 0.02
        return weights

    def dense_module(self) -> DenseLlama:
        return DenseLlama(self.arch)

    def dense_forward(self, module: nn.Module, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                      causal: bool = True) -> torch.Tensor:
        assert isinstance(module, DenseLlama)
        return module(x, key_mask)

    def build(self, group: ParallelGroup, dtype: torch.dtype) -> LlamaShard:
        self.check_world_size(group.world_size)
        return LlamaShard(self.arch, group, dtype)

    def metadata(self) -> dict[str, str]:
        return self.arch.metadata()
