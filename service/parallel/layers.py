"""Megatron-style tensor-parallel layers and multi-head attention.

Notation: `p` = world size, `r` = this rank, `E` = embed dim, `H` = heads,
`D = E / H` = head dim. All weights follow the torch Linear convention
`y = x W^T + b` with `W` of shape [out, in].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from service.parallel.linear import Activation, RowNorm, linear
from service.parallel.group import ParallelGroup
from service.parallel.kv_cache import AppendPlan, PagedKVPool, paged_attention
from service.parallel.model import load_shard_into


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output rows: A = [A_1; ...; A_p], b = [b_1; ...; b_p].

    Rank r holds A_r [out/p, in] and b_r [out/p] and computes Y_r = X A_r^T + b_r,
    i.e. columns r*out/p .. (r+1)*out/p of Y. With `gather_output=True` the shards are
    all-gathered so every rank returns the full Y [..., out]; otherwise Y_r [..., out/p].
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ParallelGroup,
        *,
        gather_output: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.group = group
        self.in_features = in_features
        self.out_features = out_features
        self.out_per_rank = _divide(out_features, group.world_size, "out_features / world_size")
        self.gather_output = gather_output
        self.weight = nn.Parameter(
            torch.empty(self.out_per_rank, in_features, dtype=dtype, device=group.device),
            requires_grad=False,
        )
        self.bias = nn.Parameter(
            torch.empty(self.out_per_rank, dtype=dtype, device=group.device), requires_grad=False
        )

    def forward(self, x: torch.Tensor, activation: Activation = "identity",
                norm: RowNorm | None = None) -> torch.Tensor:
        """x [..., in] -> act(Y_r) [..., out/p] of norm(x) (or all-gathered [..., out]): an
        elementwise activation applies shard by shard and a row norm before the shard's matmul,
        so both are fused into the rank's matmul (linear)."""
        y_local = linear(x, self.weight, self.bias, activation, norm)  # [..., out/p]
        if self.gather_output:
            return self.group.all_gather_last_dim(y_local)  # [..., out]
        return y_local


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by input columns: A = [A_1, ..., A_p], X = [X_1, ..., X_p].

    Rank r holds A_r [out, in/p] and receives X_r [..., in/p] (the matching slice of the
    input, e.g. the output of a ColumnParallelLinear). Partial products
    Y_r = X_r A_r^T are summed with all_reduce, Y = sum_r Y_r, and then the full,
    unsharded bias b [out] is added exactly once.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ParallelGroup,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.group = group
        self.in_features = in_features
        self.out_features = out_features
        self.in_per_rank = _divide(in_features, group.world_size, "in_features / world_size")
        self.weight = nn.Parameter(
            torch.empty(out_features, self.in_per_rank, dtype=dtype, device=group.device),
            requires_grad=False,
        )
        self.bias = nn.Parameter(
            torch.empty(out_features, dtype=dtype, device=group.device), requires_grad=False
        )

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        partial = linear(x_local, self.weight)  # [..., out], this rank's share
        self.group.all_reduce_(partial)  # [..., out], sum over ranks
        return partial.add_(self.bias)


def attention_bias_mask(key_mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """The boolean SDPA mask (True = attend) for `key_mask` [batch, seq] (True = token).

    Query i of row b attends key j iff key_mask[b, j] (and j <= i when causal). A padded
    query row is allowed every key instead: its output is discarded (set to 0) anyway, and
    a row with no key at all (causal + left padding: padded query 0) would make softmax
    0/0 = NaN. Every real query keeps at least itself (j = i is a token), so no real row
    is ever empty. Returns [batch, 1, seq, seq] (broadcast over heads).
    """
    seq = key_mask.shape[1]
    allowed = key_mask[:, None, None, :]  # [batch, 1, 1, seq]: which keys are tokens
    if causal:
        tril = torch.ones(seq, seq, dtype=torch.bool, device=key_mask.device).tril_()  # [seq, seq], j <= i
        allowed = allowed & tril  # [batch, 1, seq, seq]
    padded_query = ~key_mask[:, None, :, None]  # [batch, 1, seq, 1]
    return allowed | padded_query  # [batch, 1, seq, seq]


# SDPA's memory-efficient CUDA kernel wants every stride but the last of an additive mask
# to be a multiple of this many elements, else it pads the mask with a full copy per call.
_MASK_ALIGN = 16


def sdpa_mask(key_mask: torch.Tensor, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """The mask the serving path hands SDPA for `key_mask` [batch, seq] (True = token).

    Same contract as `attention_bias_mask` for every real (token) query, built without a
    [batch, 1, seq, seq] bool tensor, which SDPA would convert to an additive one in the
    compute dtype (and pad) on every step:

    - not causal: the bool key mask as [batch, 1, 1, seq], broadcast over queries and
      heads (seq bytes per row, not seq**2). A padded query row then attends the row's
      tokens like any query; a row with no token at all gets NaN at its (padded) queries,
      which the layer overwrites with 0 (the rows stay independent: the out projection
      and the all_reduce are per position).
    - causal: one additive [batch, 1, seq, seq] tensor in the compute dtype (0 = attend,
      -inf = not), filled in place (no bool [b, 1, s, s] temporary) with the padded-query
      rule of `attention_bias_mask`; on CUDA its rows are allocated 16-aligned so the
      kernel uses it as it is.
    """
    batch, seq = key_mask.shape
    if not causal:
        return key_mask[:, None, None, :]  # [batch, 1, 1, seq] bool, a view
    pad = -seq % _MASK_ALIGN if key_mask.device.type == "cuda" else 0
    bias = torch.zeros(batch, 1, seq, seq + pad, dtype=dtype, device=key_mask.device)[..., :seq]
    bias.masked_fill_(~key_mask[:, None, None, :], float("-inf"))  # keys that are padding
    future = torch.ones(seq, seq, dtype=torch.bool, device=key_mask.device).triu_(1)  # [s, s]: j > i
    bias.masked_fill_(future, float("-inf"))
    bias.masked_fill_(~key_mask[:, None, :, None], 0.0)  # a padded query may attend every key
    return bias  # [batch, 1, seq, seq]


def head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, causal: bool,
                   scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + M) v over one rank's heads: q [batch, h_l, seq, d], k, v
    [batch, kv_l, seq, d] -> [batch, seq, h_l * d], M from `key_mask` [batch, seq] (True = token)
    and `causal` (`sdpa_mask`). Grouped-query attention (kv_l < h_l, a divisor): query head i
    reads K/V head i // (h_l / kv_l)."""
    batch, heads, seq, d = q.shape
    gqa = k.shape[1] != heads
    if key_mask is None:
        # The unmasked fast path: no mask tensor at all (causal uses SDPA's own).
        ctx = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                             enable_gqa=gqa)  # [b, h_l, s, d]
    else:
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(key_mask, causal, q.dtype),
                                             scale=scale, enable_gqa=gqa)  # [b, h_l, s, d]
    return ctx.transpose(1, 2).reshape(batch, seq, heads * d)


class TensorParallelAttention(nn.Module):
    """Self-attention with heads split across ranks (scale D ** -0.5), optionally masked.

    Rank r owns heads r*H/p .. (r+1)*H/p - 1. q/k/v are ColumnParallelLinear (no gather),
    so each rank gets exactly the projections of its own heads; the out projection is a
    RowParallelLinear whose all_reduce sums the ranks' contributions:

        out = sum_r softmax(Q_r K_r^T / sqrt(D) + M) V_r  W_out[:, r-th slice]^T  + b_out

    which equals dense `nn.MultiheadAttention(E, H, bias=True, batch_first=True)`. The
    mask M is 0 where query i may attend key j and -inf elsewhere (built by `sdpa_mask`
    without a per-step [batch, 1, seq, seq] bool tensor): key j must be a token (`key_mask[b, j]`), and with `causal` also j <= i.
    The mask is per row and per position, never per head, so every rank applies the same
    M to its own heads and the sum over ranks is unchanged. Output rows at padded query
    positions are set to 0 (the contract: a padded position has no output).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        group: ParallelGroup,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = _divide(embed_dim, num_heads, "embed_dim / num_heads")
        self.heads_per_rank = _divide(num_heads, group.world_size, "num_heads / world_size")
        self.scale = self.head_dim**-0.5
        self.group = group
        self.q_proj = ColumnParallelLinear(embed_dim, embed_dim, group, dtype=dtype)
        self.k_proj = ColumnParallelLinear(embed_dim, embed_dim, group, dtype=dtype)
        self.v_proj = ColumnParallelLinear(embed_dim, embed_dim, group, dtype=dtype)
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, group, dtype=dtype)

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = t.shape
        # [batch, seq, heads_local * head_dim] -> [batch, heads_local, seq, head_dim]
        return t.view(batch, seq, self.heads_per_rank, self.head_dim).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        """x: [batch, seq, embed_dim], identical on every rank -> [batch, seq, embed_dim].

        key_mask: [batch, seq] bool, True = a token, False = padding (None: all tokens).
        causal: query i attends keys j <= i only.
        """
        ctx = self._context(x, key_mask, causal)  # [batch, seq, heads_local * head_dim]
        out = self.out_proj(ctx)  # [batch, seq, embed_dim], all-reduced
        if key_mask is not None:
            out.masked_fill_(~key_mask[..., None], 0.0)  # padded query positions have no output
        return out

    def warm_local(self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        """This rank's share of the output before the all_reduce, with no collective at all:
        runs (and so loads) the kernels a step of this shape, mask and dtype uses, on one
        rank alone (a warmup that cannot desynchronise the group)."""
        return linear(self._context(x, key_mask, causal), self.out_proj.weight)  # [batch, seq, E], partial

    def _context(self, x: torch.Tensor, key_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """q/k/v of this rank's heads and their attention: [batch, seq, heads_local * head_dim]."""
        q = self._split_heads(self.q_proj(x))  # [batch, heads_local, seq, head_dim]
        k = self._split_heads(self.k_proj(x))  # [batch, heads_local, seq, head_dim]
        v = self._split_heads(self.v_proj(x))  # [batch, heads_local, seq, head_dim]
        return head_attention(q, k, v, key_mask, causal, self.scale)

    def append(self, x: torch.Tensor, plan: AppendPlan, pool: PagedKVPool, layer: int = 0) -> torch.Tensor:
        """A session step (service.parallel.kv_cache): x [T, E], the new rows -> [T, E], all-reduced."""
        rows, h, d = x.shape[0], self.heads_per_rank, self.head_dim
        q = self.q_proj(x).view(rows, h, d)  # [T, h_l, d]
        k = self.k_proj(x).view(rows, h, d)  # [T, h_l, d]
        v = self.v_proj(x).view(rows, h, d)  # [T, h_l, d]
        ctx = paged_attention(pool, layer, q, k, v, plan, self.scale)  # [T, h_l, d]
        return self.out_proj(ctx.reshape(rows, h * d))  # [T, E], all-reduced

    def load_shard(self, shard: dict[str, torch.Tensor]) -> None:
        """Copy this rank's slice (service.parallel.attention's sharding) into the layers."""
        load_shard_into(self, shard)

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())
