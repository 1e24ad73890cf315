"""A rank's paged KV cache and the attention of new rows over it (an append step).

Pure torch, no Ray: the same code runs on rank 0 (in the GangServer replica) and on the
peers. Every placement decision is rank 0's (service.sessions.registry); a rank only
reads the plan it is sent and writes where it says, so every rank's pool holds the same
positions of the same sessions, each for its own heads.

Layout
------
One pool per rank, allocated once: ``k, v [layers, num_blocks, block_size, heads_local, head_dim]``
in the compute dtype on the rank's device (one layer per cached layer of the model; a
session's block table addresses the same blocks in each). A session of length L owns ``ceil(L / B)``
blocks (B = block_size) listed in its block table; position p lives in block
``table[p // B]`` at offset ``p % B``. Bytes per cached token per rank::

    2 (K and V) * layers * heads_local * head_dim * dtype bytes = 2 * layers * (E / p) * dtype bytes

and a session wastes at most B - 1 slots of its last block (the only layout overhead).
Sessions of any lengths share the pool without fragmenting it: any free block serves any
session.

The plan (`AppendPlan`, one int64 tensor on the wire, `encode` / `decode`)
------------------------------------------------------------------------
Sessions i = 0..S-1 of one step, each with n_i new rows (the step's x is their rows
concatenated in session order, [T, E], T = sum n_i), c_i positions already cached (0: the
session is computed from scratch, e.g. a recompute of its kept inputs) and a block table
covering its c_i + n_i positions.

Math, rank r (heads h of r), for each cached layer (its input x: the layer's input rows)::

    q, k, v = x W_{q,k,v}[h]^T + b[h]                  # [T, h_l, d] each
    K_i[c_i + j], V_i[c_i + j] = k, v of new row j     # written into the pool first
    ctx_ij = softmax(q_ij K_i[0 : c_i + j + 1]^T / sqrt(d)) V_i[0 : c_i + j + 1]
    out = sum_r ctx_r W_out[:, h]^T + b_out            # the step's one all_reduce

so new row j of session i gets row c_i + j of causal `nn.MultiheadAttention` over the
session's whole sequence, layer by layer (a layer's input rows at positions < c_i are the
ones it cached when those positions were appended). No K/V crosses ranks: each rank attends
over its own heads. `paged_attention` is the attention part; the models
(service.parallel.layers, service.parallel.transformer) compute q/k/v and the rest.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from service.parallel.huge_pages import zeros as zeros_on_huge_pages
from service.parallel.paged_kernel import InPlaceAttention, KernelStatus
from service.parallel.paged_varlen import CHECK_TOLERANCE, VarlenAttention, varlen_problem


@dataclass(frozen=True)
class AppendPlan:
    """Where one append step's rows go (see the module docstring).

    num_blocks, block_size: the pool's shape (every rank allocates the same pool from it);
    new_rows[i] = n_i, cached[i] = c_i, tables[i] = the block ids of session i's
    c_i + n_i positions (ceil((c_i + n_i) / block_size) of them)."""

    num_blocks: int
    block_size: int
    new_rows: tuple[int, ...]
    cached: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]

    @property
    def sessions(self) -> int:
        return len(self.new_rows)

    @property
    def rows(self) -> int:
        return sum(self.new_rows)

    def positions(self) -> np.ndarray:
        """[T] int64: each new row's absolute position in its session (c_i + j), in step order
        (what rotary embeddings need: an appended row continues from its session's length)."""
        return self.rows_index.positions

    @cached_property
    def rows_index(self) -> "StepRows":
        """Where the step's rows are, computed once per step (every cached layer reads it)."""
        return StepRows.of(self)

    def check(self) -> None:
        """ValueError naming the first session whose table cannot hold its positions."""
        for i, (n, c, table) in enumerate(zip(self.new_rows, self.cached, self.tables)):
            need = -(-(c + n) // self.block_size)
            if n < 1 or c < 0 or len(table) != need:
                raise ValueError(f"session {i} of the plan: {n} new rows after {c} cached need {need} blocks of "
                                 f"{self.block_size}, the table has {len(table)}")
            if any(not 0 <= b < self.num_blocks for b in table):
                raise ValueError(f"session {i} of the plan: block ids {table} outside the pool's {self.num_blocks}")

    def encode(self) -> torch.Tensor:
        """[num_blocks, block_size, S, n_0.., c_0.., len(table_0).., table_0..., table_1..., ...] int64."""
        flat = [self.num_blocks, self.block_size, self.sessions, *self.new_rows, *self.cached,
                *(len(t) for t in self.tables)]
        for t in self.tables:
            flat.extend(t)
        return torch.tensor(flat, dtype=torch.int64)

    @classmethod
    def decode(cls, meta: torch.Tensor) -> "AppendPlan":
        v = meta.tolist()
        num_blocks, block_size, s = v[0], v[1], v[2]
        new_rows, cached, lens = v[3:3 + s], v[3 + s:3 + 2 * s], v[3 + 2 * s:3 + 3 * s]
        tables, at = [], 3 + 3 * s
        for n in lens:
            tables.append(tuple(v[at:at + n]))
            at += n
        return cls(num_blocks, block_size, tuple(new_rows), tuple(cached), tuple(tables))


class PagedKVPool:
    """One rank's K/V blocks for every cached layer: k, v [layers, num_blocks, block_size, heads_local, head_dim].

    A session's block table addresses the same blocks in every layer (one plan per step)."""

    def __init__(self, num_blocks: int, block_size: int, heads_local: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, layers: int = 1) -> None:
        shape = (layers, num_blocks, block_size, heads_local, head_dim)
        self.layers, self.num_blocks, self.block_size = layers, num_blocks, block_size
        # On huge pages on a CPU rank: a step's sessions' pages lie anywhere in the pool
        self.k = zeros_on_huge_pages(shape, dtype, device)
        self.v = zeros_on_huge_pages(shape, dtype, device)
        # The in-place attention over this pool, set by the rank at warm-up: the C++ decode kernel
        # on a CPU rank (service.parallel.paged_kernel), varlen_attn on a CUDA rank in bf16/fp16
        # (service.parallel.paged_varlen); None: `paged_attention` gathers the blocks.
        self.attention: InPlaceAttention | VarlenAttention | None = None

    @property
    def nbytes(self) -> int:
        """What the pool holds on the device (both tensors)."""
        return self.k.numel() * self.k.element_size() * 2

    @property
    def bytes_per_token(self) -> int:
        """2 * layers * heads_local * head_dim * dtype bytes: one cached position of one session."""
        return self.nbytes // (self.num_blocks * self.block_size)

    def fits(self, plan: AppendPlan, layers: int, heads_local: int, head_dim: int, dtype: torch.dtype) -> bool:
        return (self.num_blocks, self.block_size) == (plan.num_blocks, plan.block_size) and \
            tuple(self.k.shape[3:]) == (heads_local, head_dim) and self.layers == layers and self.k.dtype == dtype


@dataclass(frozen=True, eq=False)
class StepRows:
    """One step's rows as every cached layer indexes them (`AppendPlan.rows_index`): built once
    per step, not once per layer, since a layer's Python is a decode step's overhead (32
    sessions: a per-layer loop over the sessions cost ~0.3 ms a layer).

    positions[t]: row t's position in its session (c_i + j); slots[t]: its flat pool slot
    (table_i[p // B] * B + p % B); starts[i]: session i's first row; single: the sessions of
    one new row (decode), single_rows their rows, single_tables / single_lengths their tables
    and lengths (c_i + 1); `slots_on(device)` the slots as a tensor there, copied once."""

    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    starts: np.ndarray  # [S] int64
    single: tuple[int, ...]
    single_rows: np.ndarray  # [S1] int64
    single_tables: tuple[tuple[int, ...], ...]
    single_lengths: tuple[int, ...]
    on_device: dict[torch.device, torch.Tensor]

    @classmethod
    def of(cls, plan: AppendPlan) -> "StepRows":
        bs = plan.block_size
        new_rows = np.asarray(plan.new_rows, dtype=np.int64)
        starts = np.zeros(len(new_rows), dtype=np.int64)
        if len(new_rows):
            np.cumsum(new_rows[:-1], out=starts[1:])
        session = np.repeat(np.arange(len(new_rows), dtype=np.int64), new_rows)  # [T] each row's session
        positions = np.asarray(plan.cached, dtype=np.int64)[session] + np.arange(int(new_rows.sum()),
                                                                                 dtype=np.int64) - starts[session]
        counts = [len(t) for t in plan.tables]
        flat = np.fromiter((b for t in plan.tables for b in t), dtype=np.int64, count=sum(counts))
        table_starts = np.zeros(len(counts), dtype=np.int64)
        if counts:
            np.cumsum(counts[:-1], out=table_starts[1:])
        slots = flat[table_starts[session] + positions // bs] * bs + positions % bs
        single = tuple(i for i, n in enumerate(plan.new_rows) if n == 1)
        return cls(positions, slots, starts, single, starts[list(single)],
                   tuple(plan.tables[i] for i in single), tuple(plan.cached[i] + 1 for i in single), {})

    def slots_on(self, device: torch.device) -> torch.Tensor:
        held = self.on_device.get(device)
        if held is None:
            held = self.on_device[device] = torch.from_numpy(self.slots).to(device)
        return held


def paged_attention(pool: PagedKVPool, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    plan: AppendPlan, scale: float) -> torch.Tensor:
    """One cached layer of an append step, on this rank's heads: q [T, h_l, d], k, v [T, kv_l, d]
    of the plan's new rows (their projections) -> ctx [T, h_l, d]. With grouped-query attention
    (kv_l < h_l, h_l a multiple of kv_l) query head i reads K/V head i // (h_l / kv_l); the pool
    holds kv_l heads.

    Writes k/v into `pool` layer `layer` at the plan's positions, then attends each new row over
    its session's cached positions and the earlier new rows (module docstring). Where the pool
    has an in-place kernel (`pool.attention`, set by the rank at warm-up: the C++ decode kernel
    of service.parallel.paged_kernel on CPU, varlen_attn on CUDA) the one-row appends' attention
    reads the pool's blocks where they lie (varlen: every row); the other rows, and every row
    without a kernel, gather them (`gather_attention`, the same math).
    """
    rows, h, d = q.shape
    kv = k.shape[1]
    pool_k, pool_v = pool.k[layer], pool.v[layer]  # [num_blocks, B, kv_l, d]
    index = plan.rows_index
    slots = index.slots_on(q.device)
    pool_k.view(-1, kv, d).index_copy_(0, slots, k)  # flat pool [num_blocks * B, kv_l, d]
    pool_v.view(-1, kv, d).index_copy_(0, slots, v)
    kernel = pool.attention
    if kernel is None or not kernel.matches(h, kv, d, q.dtype):
        return gather_attention(pool_k, pool_v, q, plan, scale)
    if isinstance(kernel, VarlenAttention):  # one call for the whole step, every row count alike
        return kernel.attend(pool_k, pool_v, q, plan, scale)
    if not index.single:  # appends of several rows gather (paged_kernel: "Which rows")
        return gather_attention(pool_k, pool_v, q, plan, scale)
    # One-row appends (decode) share one call of the kernel over the pool in place; the rest,
    # if any, gather (gather_attention computes only the sessions of several rows then).
    if len(index.single) == plan.sessions:  # every row a session's one row, in session order
        return kernel.decode(pool_k, pool_v, q, index.single_tables, index.single_lengths, scale, plan)
    at = torch.from_numpy(index.single_rows).to(q.device)
    decoded = kernel.decode(pool_k, pool_v, q[at], index.single_tables, index.single_lengths, scale, plan)
    ctx = gather_attention(pool_k, pool_v, q, plan, scale, skip_single=True)
    ctx[at] = decoded
    return ctx


def warm_varlen(kernel: VarlenAttention, device: torch.device, scale: float) -> KernelStatus:
    """A CUDA rank's warm-up of `kernel` (service.parallel.paged_varlen): where the device, dtype,
    page size and torch allow it, run two steps on a scratch pool of 5 pages and compare each with
    the gather path on the same inputs. KernelStatus("varlen", ...) when they agree within
    CHECK_TOLERANCE, else KernelStatus("gather", why). The steps: a decode step (one row each at
    lengths 1 and B + 3, the longer over pages out of order: FlashAttention takes another route
    for one query row, grouped-query heads folded into rows) and a mixed step (the same two rows
    and a chunk of 5 rows after B - 2 cached positions, crossing a page)."""
    problem = varlen_problem(device, kernel.dtype, kernel.block_size)
    if problem is not None:
        return KernelStatus("gather", problem)
    started = time.monotonic()
    b, gen = kernel.block_size, torch.Generator(device="cpu").manual_seed(0)
    plans = (AppendPlan(5, b, (1, 1), (0, b + 2), ((4,), (3, 0))),
             AppendPlan(5, b, (1, 1, 5), (0, b + 2, b - 2), ((4,), (3, 0), (1, 2))))
    scratch_k, scratch_v = (torch.randn(5, b, kernel.kv_heads, kernel.head_dim, generator=gen).to(device, kernel.dtype)
                            for _ in range(2))
    error = 0.0
    try:
        for plan in plans:
            q = torch.randn(plan.rows, kernel.q_heads, kernel.head_dim, generator=gen).to(device, kernel.dtype)
            with torch.inference_mode():
                got = kernel.attend(scratch_k, scratch_v, q, plan, scale).float()
                want = gather_attention(scratch_k, scratch_v, q, plan, scale).float()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # a kernel's launch error surfaces here, inside the check
            error = max(error, float((got - want).abs().max() / want.abs().max().clamp_min(1e-6)))
    except Exception as exc:  # noqa: BLE001 - any refusal of the kernel leaves the gather path
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return KernelStatus("gather", f"varlen_attn failed its warm-up step ({type(exc).__name__}: {first})")
    finally:
        kernel.forget_step()
    tolerance = CHECK_TOLERANCE[kernel.dtype]
    if not error <= tolerance:
        return KernelStatus("gather", f"varlen_attn disagreed with the gather path at warm-up: max |difference| "
                                      f"{error:.2e} of the largest output (at most {tolerance:g})")
    return KernelStatus("varlen", f"varlen_attn (FlashAttention) over the pool's pages, checked against the gather "
                                  f"path at warm-up (max |difference| {error:.1e})",
                        round(time.monotonic() - started, 3), len(plans))


def gather_attention(pool_k: torch.Tensor, pool_v: torch.Tensor, q: torch.Tensor, plan: AppendPlan,
                     scale: float, skip_single: bool = False) -> torch.Tensor:
    """The gather path (the pool's K/V already hold the step's rows): sessions of one new row
    (decode steps) share one batched attention over their block tables gathered and padded to
    the longest; sessions of several rows (a prefill, a recompute) get one causal attention each
    over their gathered positions. q [T, h_l, d], pool_k/v [num_blocks, B, kv_l, d] -> [T, h_l, d].
    `skip_single`: leave the one-row appends' rows unset (the caller attends them in place)."""
    rows, h, d = q.shape
    kv = pool_k.shape[2]
    bs, device = plan.block_size, q.device
    gqa = kv != h  # SDPA broadcasts each K/V head over its h_l / kv_l query heads
    ctx = torch.empty(rows, h, d, dtype=q.dtype, device=device)  # [T, h_l, d]
    index = plan.rows_index
    starts = index.starts
    if index.single and not skip_single:
        widest = max(len(t) for t in index.single_tables)
        tables = torch.tensor([list(t) + [0] * (widest - len(t)) for t in index.single_tables],
                              dtype=torch.int64, device=device)  # [S1, nb_max]
        lengths = torch.tensor(index.single_lengths, dtype=torch.int64, device=device)
        s1 = len(index.single)
        keys = pool_k[tables].view(s1, widest * bs, kv, d).transpose(1, 2)  # [S1, kv_l, L_max, d]
        vals = pool_v[tables].view(s1, widest * bs, kv, d).transpose(1, 2)  # [S1, kv_l, L_max, d]
        allowed = torch.arange(widest * bs, device=device)[None, :] < lengths[:, None]  # [S1, L_max]
        at = torch.from_numpy(index.single_rows).to(device)
        qs = q[at][:, :, None, :]  # [S1, h_l, 1, d]
        out = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=allowed[:, None, None, :],
                                             scale=scale, enable_gqa=gqa)  # [S1, h_l, 1, d]
        ctx[at] = out[:, :, 0, :]
    for i, n in enumerate(plan.new_rows):
        if n == 1:
            continue
        start = int(starts[i])
        ctx[start:start + n] = _gather_rows(pool_k, pool_v, q[start:start + n], plan.tables[i], plan.cached[i], scale)
    return ctx


def _gather_rows(pool_k: torch.Tensor, pool_v: torch.Tensor, q: torch.Tensor, table: tuple[int, ...], c: int,
                 scale: float) -> torch.Tensor:
    """One session's n rows at positions c .. c + n - 1 over its gathered K/V: q [n, h_l, d] -> [n, h_l, d]."""
    n, h, d = q.shape
    _, bs, kv, _ = pool_k.shape
    device = q.device
    length = c + n
    ids = torch.tensor(table, dtype=torch.int64, device=device)
    keys = pool_k[ids].view(len(table) * bs, kv, d)[:length].transpose(0, 1)  # [kv_l, L, d]
    vals = pool_v[ids].view(len(table) * bs, kv, d)[:length].transpose(0, 1)  # [kv_l, L, d]
    # 4-D [1, h_l, ., d]: on CPU, SDPA takes its fused kernel only for 4-D inputs (3-D falls
    # back to the math kernel, ~6x slower on a 2048-row prefill: bench/NOTES.md).
    qi = q.transpose(0, 1)[None]  # [1, h_l, n, d]
    keys, vals = keys[None], vals[None]  # [1, kv_l, L, d]
    gqa = kv != h
    if c == 0:  # a prefill or a recompute: plain causal attention, no mask tensor (SDPA's own)
        out = F.scaled_dot_product_attention(qi, keys, vals, is_causal=True, scale=scale,
                                             enable_gqa=gqa)  # [1, h_l, n, d]
    else:
        # new row j sits at position c + j and attends positions 0 .. c + j
        allowed = torch.arange(length, device=device)[None, :] <= (c + torch.arange(n, device=device))[:, None]
        out = F.scaled_dot_product_attention(qi, keys, vals, attn_mask=allowed, scale=scale,
                                             enable_gqa=gqa)  # [1, h_l, n, d]
    return out[0].transpose(0, 1)
