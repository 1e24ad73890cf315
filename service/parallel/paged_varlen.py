"""Attention over a rank's paged KV pool in place on CUDA, in bfloat16 or float16: torch's
`torch.nn.attention.varlen.varlen_attn` (FlashAttention's variable-length kernel) reading the
pool's pages through a block table (issue 52, item 2: "CUDA with bf16/fp16").

Why: a CUDA rank has no in-place kernel otherwise (service.parallel.paged_kernel builds its
C++ decode kernel for CPU ranks only), so its session steps gather: every one-row append copies its
session's whole K/V, pool -> copy -> attention, about 3x the K/V bytes a step must read.

Layout: one layer of the pool, [num_blocks, B, kv_l, d], *is* the kernel's paged layout
(total_pages, page_size, H_kv, D), read where it lies (no view, no copy). One call serves a whole
step, every session and every row count (decode rows, prefill chunks, recomputes) alike:

    q           [T, h_l, d]   the step's rows, session after session (the plan's order)
    cu_seq_q    [S + 1]       0, n_0, n_0 + n_1, ... (int32): session i's rows are q[cu[i]:cu[i+1]]
    seqused_k   [S]           L_i = c_i + n_i: the positions session i holds after this step
    cu_seq_k    [S + 1]       the running sum of L_i (the kernel's own bookkeeping of key lengths)
    block_table [S, W]        session i's table, padded with block 0 to the widest W (int32; the
                              kernel reads only the blocks that hold its first L_i positions)

Math (exactly the gather path's, service.parallel.kv_cache): causal attention with the window
(-1, 0), which FlashAttention aligns at the bottom right when a sequence has fewer query rows
than keys: row j of session i's n_i rows attends keys 0 .. L_i - n_i + j = c_i + j, which is
position c_i + j attending its own session's positions up to itself, softmax(q K^T * scale) V;
query head h reads K/V head h // (h_l / kv_l) (`enable_gqa`). A step of one-row appends only
(decode) passes no window, (-1, -1): each row is its session's last position and attends all of
it either way, and without a window FlashAttention may fold a K/V head's query heads into rows
(its `seqlenq_ngroups_swapped` route for one query row and grouped-query heads).

Where it applies is decided on the device, once, at warm-up (`varlen_problem`, then
service.parallel.kv_cache.warm_varlen, beside the gather path it is checked against):
a CUDA device, bfloat16 or float16, a torch whose `varlen_attn` takes `block_table`,
`seqused_k` and `window_size`, pages of a multiple of 256 positions (torch's FlashAttention 2
refuses other paged layouts: "Paged KV cache block size must be divisible by 256", so
`session_block_tokens` must be 256, 512, ...), and then a warm-up step on a scratch pool that
must equal the gather path on the same inputs (decode rows of uneven lengths and a chunk of rows
after cached positions, pages out of order). Anything else keeps the gather path, and
`KernelStatus.reason` (GET /gang `sessions.attention`) says which condition failed.

Not run on a GPU in this repository's CI (none is lent there): the warm-up's check is what
guards a user's GPU, and `bench/gpu_check.sh` (tier A) measures this path's parity against
float64 and its decode step against the gather path on the first GPU lent.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

# torch's FlashAttention 2 (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp)
# checks `page_block_size % 256 == 0` for a paged K/V.
PAGE_MULTIPLE = 256
VARLEN_DTYPES = (torch.bfloat16, torch.float16)  # FlashAttention's dtypes
# The warm-up's check against the gather path (service.parallel.kv_cache.warm_varlen): the largest
# |difference| allowed, relative to the largest |output| (both from the same bf16/fp16 inputs;
# bf16 keeps 8 bits of mantissa).
CHECK_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
_NEEDED_ARGUMENTS = ("block_table", "seqused_k", "window_size")


@functools.cache
def _varlen_attn() -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    """torch's varlen_attn, or why this torch has none that reads a paged pool (looked up once:
    `attend` asks on every layer of every step)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen ({exc})"
    missing = [a for a in _NEEDED_ARGUMENTS if a not in inspect.signature(varlen_attn).parameters]
    if missing:
        return None, f"torch {torch.__version__}'s varlen_attn takes no {', '.join(missing)} (a paged K/V needs them)"
    return varlen_attn, None


def varlen_problem(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
    """Why the varlen kernel cannot serve this pool (None: it may, subject to `warm`'s check)."""
    if device.type != "cuda":
        return f"varlen_attn runs on CUDA only, this rank is on {device.type}"
    if dtype not in VARLEN_DTYPES:
        return f"varlen_attn (FlashAttention) takes bfloat16 or float16, the compute dtype is {str(dtype)[6:]}"
    if block_size % PAGE_MULTIPLE:
        return (f"varlen_attn reads a paged K/V in pages of a multiple of {PAGE_MULTIPLE} positions, "
                f"session_block_tokens is {block_size}")
    return _varlen_attn()[1]


class StepSessions(Protocol):
    """What the kernel reads of a step's plan (service.parallel.kv_cache.AppendPlan)."""

    @property
    def new_rows(self) -> tuple[int, ...]: ...

    @property
    def cached(self) -> tuple[int, ...]: ...

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]: ...


@dataclass(frozen=True)
class VarlenArgs:
    """One step's arguments to varlen_attn besides q and the pool (module docstring's table)."""

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    max_q: int
    max_k: int
    window: tuple[int, int]  # (-1, 0): causal at the bottom right; (-1, -1) when every session has one row

    @classmethod
    def of(cls, new_rows: Sequence[int], cached: Sequence[int], tables: Sequence[Sequence[int]],
           device: torch.device) -> "VarlenArgs":
        """From a plan's fields: session i has new_rows[i] rows after cached[i] positions, its
        blocks tables[i] (covering all cached[i] + new_rows[i] positions)."""
        lengths = [c + n for n, c in zip(new_rows, cached)]
        widest = max(len(t) for t in tables)
        table = torch.tensor([list(t) + [0] * (widest - len(t)) for t in tables], dtype=torch.int32)
        cu_q = torch.zeros(len(new_rows) + 1, dtype=torch.int32)
        cu_q[1:] = torch.tensor(new_rows, dtype=torch.int32).cumsum(0)
        cu_k = torch.zeros(len(new_rows) + 1, dtype=torch.int32)
        cu_k[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        return cls(cu_q.to(device), cu_k.to(device), torch.tensor(lengths, dtype=torch.int32).to(device),
                   table.to(device), max(new_rows), max(lengths), (-1, 0) if max(new_rows) > 1 else (-1, -1))


class VarlenAttention:
    """A CUDA rank's in-place attention over its pool: one varlen_attn call per cached layer of a
    step (module docstring). Nothing is compiled; service.parallel.kv_cache.warm_varlen checks it
    against the gather path before a rank uses it."""

    def __init__(self, num_blocks: int, block_size: int, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        if q_heads % kv_heads:
            raise ValueError(f"query heads ({q_heads}) must be a multiple of the pool's K/V heads ({kv_heads})")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.q_heads, self.kv_heads, self.head_dim, self.dtype = q_heads, kv_heads, head_dim, dtype
        self._plan: StepSessions | None = None  # the step whose arguments `_args` holds (built once per step)
        self._args: VarlenArgs | None = None

    def matches(self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        return (q_heads, kv_heads, head_dim, dtype) == (self.q_heads, self.kv_heads, self.head_dim, self.dtype)

    def attend(self, pool_k: torch.Tensor, pool_v: torch.Tensor, q: torch.Tensor, plan: StepSessions,
               scale: float) -> torch.Tensor:
        """q [T, h_l, d] of the plan's rows (their K/V already written into the pool layer
        pool_k/pool_v [num_blocks, B, kv_l, d]) -> ctx [T, h_l, d]. The step's arguments are
        built for its first cached layer and reused by the others (the same plan object)."""
        varlen_attn, problem = _varlen_attn()
        if varlen_attn is None:
            raise RuntimeError(problem)
        if self._plan is not plan or self._args is None:
            self._plan, self._args = plan, VarlenArgs.of(plan.new_rows, plan.cached, plan.tables, q.device)
        a = self._args
        return varlen_attn(q, pool_k, pool_v, a.cu_seq_q, a.cu_seq_k, a.max_q, a.max_k, scale=scale,
                           window_size=a.window, enable_gqa=self.q_heads != self.kv_heads, seqused_k=a.seqused_k,
                           block_table=a.block_table)

    def forget_step(self) -> None:
        """Drop the arguments kept for the last step (a check's scratch steps are not a real one)."""
        self._plan = self._args = None
