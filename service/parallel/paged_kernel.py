"""Attention over a rank's paged KV pool in place: torch's `flex_attention`, compiled, with a
paged block mask (issue 52, item 2).

Why: the gather path (service.parallel.kv_cache.gather_attention) copies every session's
blocks, `pool[tables]` padded to the widest table, before attention: per one-row append it
reads the pool, writes the copy and reads the copy again (about 3x the session's K/V bytes).
Here the kernel reads each session's blocks where they lie: K and V are the pool's own layer
viewed as [1, kv_l, num_blocks * B, d] (no copy: the view's last dim is contiguous, which is
all the CPU kernel needs), and a `BlockMask` whose KV block is the page size B lists, for
every query row (or block of query rows), the physical blocks it reads in logical order.

Math (exactly the gather path's): query row j of session i sits at position c_i + j and
attends positions 0 .. c_i + j of its session, softmax(q K^T * scale) V, query head h reading
K/V head h // (h_l / kv_l) (grouped-query attention: rows calls pass `enable_gqa`; decode calls
pack a K/V head's query heads as its rows, see `decode`). A block whose positions
are all allowed for every row of a query block is a *full* block (no mask evaluated); the
block holding the boundary is *partial*, and its mask is evaluated per element:

    decode (one-row appends, q [S, kv_l, h_l / kv_l, d]: a K/V head's query heads as its rows, one
        query block per session):
        full    = table[0 : nb - 1] (and the last one when the length fills it)
        partial = table[nb - 1] when length % B != 0; allowed iff kv % B < length - (nb - 1) * B
    rows (one session's n rows, q [1, h_l, n, d], query blocks of Q_BLOCK rows):
        block lb (logical) is full for query block qb iff (lb + 1) * B - 1 <= c + qb * Q_BLOCK,
        partial iff it is not full and lb * B <= c + last row of qb; allowed iff
        logical(kv) <= c + q_idx, logical(kv) = p2l[kv // B] * B + kv % B

Masks carry no query-side index (`compute_q_blocks=False`): only a backward pass reads it, and
building it (a dense transpose over the pool's blocks, on the request path once per step) cost
1.1 / 5.3 / 20.0 ms for a step of 1 / 8 / 32 sessions over a 4,136-block pool, against
0.07 / 0.35 / 1.36 ms without (1 thread).

Shapes are static (compiled once each, at warm-up): the kernel's dynamic-shape path in torch
2.13 miscompiles (its C++ template renames the symbols `ks1`, `ks10` ... by plain string
replacement, so `ks1` inside `ks10` is corrupted: a compile error or a division by zero at
run time). So decode groups are padded to DECODE_BUCKETS sessions (a padding entry's output is
discarded) and a session's rows to ROW_BUCKETS (padding rows are discarded); more
rows than the largest bucket are split, which changes nothing in the math (every row attends
the pool, where this step's K/V are already written).

A step of few decoding sessions (at most DECODE_ALONE_UP_TO) gives each a call of its own (the
bucket of 1 in DECODE_BUCKETS): for one query row over a pool of at least 512 positions per batch
entry, inductor's CPU template is its decoding kernel (torch 2.13,
`cpp_flex_attention_template.py`: work split over the session's KV blocks in partitions of 128
positions). It takes that split only when every batch entry has the same numbers of full and
partial KV blocks; otherwise it splits the *whole pool's* length into partitions and scans every
block of the entry in each: work and tasks grow with the pool, not the session. A call of one
session always takes the split by its own blocks. More sessions share one call (padded to the
next of 4, 8, 16 or 32): each call is a parallel region of its own, and on 2 threads of a shared
machine 4 sessions' calls cost more than the one padded call. A shared call's mask gives every
entry the same block counts (`_decode_mask`: the fewest full blocks as full, the rest as partial
blocks whose mask allows what the entry holds; a shorter session and a padding entry list filler
blocks the mask refuses), so sessions of different lengths and padding entries keep the split.
Measured (bench/micro_levers.py decode and bench/decode.py --in-process, 12 layers x 12 heads of
64 at context 2048, CPU time against the gather path's, one process; bench/NOTES.md):

    sessions                           1     2     4     8     16    32    (1 thread, lengths differ)
    one padded call of 4/32 (first)    1.44  1.25  1.06  -     -     0.77
    a call per session                 0.69  0.70  0.58  -     -     0.33
    uneven masks, calls of 1/4/32      0.84  0.87  1.91  1.15  -     0.76
    even masks, calls of 1/4/8/16/32   0.86  -     0.73  0.30  0.29  0.29

After warm-up every call runs under `torch.compiler.set_stance("fail_on_recompile")`: a
shape that was not compiled raises (`NotWarmed`) instead of compiling on a user's request,
and the caller uses the gather path for that call.

Which rows: one-row appends (decode) always read in place: there the gather's copy is the
cost (3x the K/V bytes). Appends of several rows (prefill chunks, recomputes, multi-row
appends) gather by default: the copy is 1/n of their work per row, and on CPU at 16-token pages
torch's fused SDPA over the copy beat the rows kernel's 64 x 16 tiles (measured, 12 layers,
6 heads, 100 rows at context 1500: 92 ms gathered, 185 ms in place; bench/NOTES.md, issue 52).
`rows_in_place=True` reads them in place too (the parity tests run it: same math). In bf16/fp16
the CPU kernel would also pack the *whole* K (every pool position) for 64 or more query rows.
CUDA: not used (a CUDA rank in bf16/fp16 reads its pool through varlen_attn instead:
service.parallel.paged_varlen); `compiler_problem` says so.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Sequence

import torch

log = logging.getLogger("gangserve.rank")

# One-row appends per decode call (padded up: a padding row has no block); 1: a session alone.
DECODE_BUCKETS = (1, 4, 8, 16, 32)
DECODE_ALONE_UP_TO = 2  # a step of at most this many one-row appends calls once per session (docstring)
ROW_BUCKETS = (64,)  # query rows per rows call (padded up; more rows are split into calls of 64)
Q_BLOCK = 64  # query rows per BlockMask row block in rows calls (the causal boundary's granularity)
# Distinct compiled shapes a process may hold (every pool shape x the buckets x dtypes a test
# process builds); dynamo's default of 8 would silently fall back to eager flex_attention.
_RECOMPILE_LIMIT = 256


class NotWarmed(RuntimeError):
    """A call of a shape that was not compiled at warm-up (the caller falls back)."""


@dataclass(frozen=True)
class KernelStatus:
    """Which attention a rank's session steps use, and why (GET /gang `sessions.attention`)."""

    # "in_place" (compiled flex_attention over the pool, CPU) | "varlen" (varlen_attn over the
    # pool's pages, CUDA: service.parallel.paged_varlen) | "gather" (each session's blocks copied)
    path: str
    reason: str  # why this path, in words
    compile_s: float = 0.0  # seconds the warm-up's compilation (or check) took (0: none)
    shapes: int = 0  # compiled shapes (varlen: the warm-up steps it was checked on)

    @property
    def in_place(self) -> bool:
        """Steps read the pool where it lies (no per-step copy of a session's K/V)."""
        return self.path in ("in_place", "varlen")


def compiler_problem(device: torch.device) -> str | None:
    """Why the in-place kernel cannot run on `device` (None: it can)."""
    if device.type != "cpu":
        return (f"the compiled in-place kernel is built and tested for CPU only; {device.type} keeps the gather "
                "path (flex_attention on CUDA is untested here; CUDA in bf16/fp16: service.parallel.paged_varlen)")
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - any failure to find one means: no compiler
        return f"no C++ compiler for torch.compile on CPU ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    return None


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


_compiled: Callable[..., torch.Tensor] | None = None


def _flex() -> Callable[..., torch.Tensor]:
    """The one compiled flex_attention of this process (static shapes: see the module docstring)."""
    global _compiled
    if _compiled is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _RECOMPILE_LIMIT)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * _RECOMPILE_LIMIT)
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


@dataclass(frozen=True)
class KernelShape:
    """What one rank's in-place attention is compiled for: the pool's pages (num_blocks x
    block_size), its K/V heads, the query heads reading it, the head width and the dtype. Every
    peer of a gang has the same (heads split evenly), and a process compiles a shape once for
    every pool of it (the one `_flex`): so a warm spare that compiled its gang's shape before it
    is adopted warms up in milliseconds (`compile_shape`, service.gang.spare)."""

    num_blocks: int
    block_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


def compile_shape(shape: KernelShape, budget_s: float) -> KernelStatus:
    """Compile `shape`'s kernel in this process, over a scratch pool of one layer of zeros
    (freed on return), at most `budget_s` of compiling (InPlaceAttention.warm)."""
    pool_k = torch.zeros(shape.num_blocks, shape.block_size, shape.kv_heads, shape.head_dim, dtype=shape.dtype)
    kernel = InPlaceAttention(shape.num_blocks, shape.block_size, shape.q_heads, shape.kv_heads, shape.head_dim,
                              shape.dtype)
    return kernel.warm(pool_k, torch.zeros_like(pool_k), shape.head_dim ** -0.5, budget_s)


class InPlaceAttention:
    """The compiled in-place attention for one pool: its pages (num_blocks x block_size), its
    K/V heads, head width and dtype, and the query heads of the model reading it."""

    def __init__(self, num_blocks: int, block_size: int, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, rows_in_place: bool = False,
                 decode_buckets: Sequence[int] = DECODE_BUCKETS, alone_up_to: int = DECODE_ALONE_UP_TO) -> None:
        """`rows_in_place`: appends of several rows read the pool in place too (else they gather:
        see the module docstring, "Which rows"). `decode_buckets`: the decode group widths
        compiled at warm-up (ascending; a group is padded up to the first that holds it);
        `alone_up_to`: a step of at most this many one-row appends calls once per session (needs
        the bucket 1)."""
        if q_heads % kv_heads:
            raise ValueError(f"query heads ({q_heads}) must be a multiple of the pool's K/V heads ({kv_heads})")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.q_heads, self.kv_heads, self.head_dim, self.dtype = q_heads, kv_heads, head_dim, dtype
        if list(decode_buckets) != sorted(set(decode_buckets)) or decode_buckets[0] < 1:
            raise ValueError(f"decode buckets must be ascending positive widths, got {tuple(decode_buckets)}")
        if alone_up_to > 0 and decode_buckets[0] != 1:
            raise ValueError(f"calls of one session alone (alone_up_to={alone_up_to}) need the decode bucket 1, "
                             f"got {tuple(decode_buckets)}")
        self.decode_buckets, self.alone_up_to = tuple(decode_buckets), alone_up_to
        self.warmed = False
        self.rows_in_place = rows_in_place and dtype == torch.float32  # module docstring: "Which rows"
        self._plan: object | None = None  # the step whose masks `_masks` holds (`_memo`)
        self._masks: dict[tuple, object] = {}

    @property
    def shape(self) -> KernelShape:
        return KernelShape(self.num_blocks, self.block_size, self.q_heads, self.kv_heads, self.head_dim, self.dtype)

    def matches(self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        return (q_heads, kv_heads, head_dim, dtype) == (self.q_heads, self.kv_heads, self.head_dim, self.dtype)

    # -- the pool as the kernel reads it -----------------------------------------------------
    def _kv(self, pool_layer: torch.Tensor) -> torch.Tensor:
        """[num_blocks, B, kv_l, d] -> [1, kv_l, num_blocks * B, d], a view (no copy)."""
        n, b, kv, d = pool_layer.shape
        return pool_layer.view(1, n * b, kv, d).transpose(1, 2)

    def _call(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask: object,
              scale: float) -> torch.Tensor:
        flex = _flex()
        gqa = q.shape[1] != keys.shape[1]  # a decode call packs a group's heads as rows: no gqa there
        if not self.warmed:
            return flex(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=gqa)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return flex(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=gqa)
        except Exception as exc:  # noqa: BLE001 - a shape not compiled at warm-up: never compile here
            raise NotWarmed(f"in-place attention of shape {tuple(q.shape)} was not compiled at warm-up: "
                            f"{type(exc).__name__}") from exc

    # -- one step's masks, built once for all its layers ------------------------------------------
    def _memo(self, plan: object | None, key: tuple, build: Callable[[], object]) -> object:
        """`build()` once per step and `key`: every cached layer of a step has the same plan
        (the same object), so its block masks are built for the first layer only."""
        if plan is None:
            return build()
        if self._plan is not plan:
            self._plan, self._masks = plan, {}
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]

    # -- decode: one query row per batch entry ----------------------------------------------------
    @property
    def group(self) -> int:
        """Query heads per K/V head (1 without grouped-query attention)."""
        return self.q_heads // self.kv_heads

    def decode(self, pool_k: torch.Tensor, pool_v: torch.Tensor, q: torch.Tensor, tables: Sequence[Sequence[int]],
               lengths: Sequence[int], scale: float, plan: object | None = None) -> torch.Tensor:
        """q [S, h_l, d] (row i at position lengths[i] - 1 of the session whose table is
        tables[i]) -> ctx [S, h_l, d]. `plan`: the step's, to build its masks once for all layers.

        With grouped-query attention the call packs each K/V head's group of G query heads as
        G query rows of that head, q [S, kv_l, G, d] (query head h = k G + g reads K/V head k,
        as `enable_gqa` maps it): one row attends the same keys whatever its position here
        (the mask ignores the query index), and the kernel then reads each K/V block once per
        group instead of once per query head: 1.55-1.8x faster per call at 16 query heads over
        4 K/V heads (bench/NOTES.md), the same outputs."""
        out = torch.empty_like(q)
        top = 1 if q.shape[0] <= self.alone_up_to else self.decode_buckets[-1]
        keys, values = self._kv(pool_k), self._kv(pool_v)
        g = self.group
        for at in range(0, q.shape[0], top):
            part = slice(at, min(at + top, q.shape[0]))
            k = part.stop - at
            width = _bucket(k, self.decode_buckets)
            mask = self._memo(plan, ("decode", at), lambda: self._decode_mask(tables[part], lengths[part], width))
            qs = torch.zeros(width, self.kv_heads, g, self.head_dim, dtype=q.dtype, device=q.device)
            qs[:k] = q[part].view(k, self.kv_heads, g, self.head_dim)
            out[part] = self._call(qs, keys, values, mask, scale)[:k].reshape(k, self.q_heads, self.head_dim)
        return out

    def _decode_mask(self, tables: Sequence[Sequence[int]], lengths: Sequence[int], width: int) -> object:
        """The mask of one decode call: `tables` and `lengths` of its sessions, padding entries up
        to `width`. Every entry gets the same numbers of full and partial blocks, so the CPU
        template takes its split by the entries' own blocks (module docstring):
        - F full blocks each, F = the fewest full blocks of the call's sessions: an entry's first
          F blocks (a padding entry reads any F blocks; its output is discarded);
        - P partial blocks each, P = the widest session's block count - F: an entry's remaining
          blocks, then blocks outside its own table (a block listed twice would be read twice)
          up to P. `mask_mod` allows, per entry and physical block, the positions the entry
          holds of it: B for a whole block, the rest for its last one, none for the fillers.
        Sessions of one length (and a lone session) get exactly their own blocks; a shorter
        session checks the mask on at most the widest's extra blocks."""
        from torch.nn.attention.flex_attention import BlockMask

        bs, n = self.block_size, self.num_blocks
        counts = [-(-length // bs) for length in lengths]
        fulls = [count if length == count * bs else count - 1 for length, count in zip(lengths, counts)]
        first, widest = min(fulls), max(counts)
        partial = widest - first
        full_idx = torch.zeros(width, 1, 1, n, dtype=torch.int32)
        partial_idx = torch.zeros(width, 1, 1, n, dtype=torch.int32)
        allowed = torch.zeros(width, n, dtype=torch.int32)  # positions entry b may read of physical block k
        for i, (table, length, count) in enumerate(zip(tables, lengths, counts)):
            own = [int(b) for b in table[:count]]
            full_idx[i, 0, 0, :first] = torch.tensor(own[:first], dtype=torch.int32)
            rest = own[first:]
            if rest:
                allowed[i, rest] = bs
                allowed[i, own[-1]] = length - (count - 1) * bs
            mine = set(own)
            # the first blocks outside the entry's table, found lazily: a step's mask is built on the
            # request path, and scanning the whole pool per session cost O(S x num_blocks) there
            fill = list(islice((b for b in range(n) if b not in mine), partial - len(rest)))
            partial_idx[i, 0, 0, :partial] = torch.tensor(rest + fill, dtype=torch.int32)
        full_idx[len(tables):, 0, 0, :first] = torch.arange(first, dtype=torch.int32)  # padding: discarded
        partial_idx[len(tables):, 0, 0, :partial] = torch.arange(partial, dtype=torch.int32)  # allowed none
        full_num = torch.full((width, 1, 1), first, dtype=torch.int32)
        partial_num = torch.full((width, 1, 1), partial, dtype=torch.int32)

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return kv_idx % bs < allowed[b, kv_idx // bs]

        rows = self.group  # a call's query rows: the packed group's heads (`decode`)
        return BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=(rows, bs),
                                        mask_mod=mask_mod, seq_lengths=(rows, n * bs), compute_q_blocks=False)

    # -- rows: one session's several new rows (a prefill chunk, a recompute, a multi-row append) --
    def rows(self, pool_k: torch.Tensor, pool_v: torch.Tensor, q: torch.Tensor, table: Sequence[int], cached: int,
             scale: float, plan: object | None = None, key: int = 0) -> torch.Tensor:
        """q [n, h_l, d]: rows at positions cached .. cached + n - 1 of one session whose table
        covers them -> ctx [n, h_l, d], causal over the session's whole sequence. `plan`, `key`:
        the step's and the session's place in it, to build the masks once for all layers."""
        out = torch.empty_like(q)
        top = ROW_BUCKETS[-1]
        keys, values = self._kv(pool_k), self._kv(pool_v)
        for at in range(0, q.shape[0], top):
            end = min(at + top, q.shape[0])
            width = _bucket(end - at, ROW_BUCKETS)
            mask = self._memo(plan, ("rows", key, at), lambda: self._rows_mask(table, cached + at, end - at, width))
            qs = torch.zeros(1, self.q_heads, width, self.head_dim, dtype=q.dtype, device=q.device)
            qs[0, :, :end - at] = q[at:end].transpose(0, 1)
            out[at:end] = self._call(qs, keys, values, mask, scale)[0, :, :end - at].transpose(0, 1)
        return out

    def _rows_mask(self, table: Sequence[int], first: int, m: int, width: int) -> object:
        """The mask of m query rows at positions first .. first + m - 1 (padded to width)."""
        from torch.nn.attention.flex_attention import BlockMask

        bs, n = self.block_size, self.num_blocks
        qb_size = min(Q_BLOCK, width)
        blocks_q = max(2, width // qb_size)  # >= 2: a dimension of 1 is specialised apart
        partial_num = torch.zeros(1, 1, blocks_q, dtype=torch.int32)
        partial_idx = torch.zeros(1, 1, blocks_q, n, dtype=torch.int32)
        full_num = torch.zeros(1, 1, blocks_q, dtype=torch.int32)
        full_idx = torch.zeros(1, 1, blocks_q, n, dtype=torch.int32)
        ids = torch.tensor(list(table), dtype=torch.int32)
        p2l = torch.full((1, n), -1, dtype=torch.int32)  # physical block -> its logical index
        p2l[0, ids.to(torch.int64)] = torch.arange(len(table), dtype=torch.int32)
        for qb in range(-(-m // qb_size)):
            lo = first + qb * qb_size  # the query block's first and last real rows' positions
            hi = first + min(m, (qb + 1) * qb_size) - 1
            full = (lo + 1) // bs  # logical blocks 0 .. full - 1 end at or before lo
            last = hi // bs  # the last block any row of this query block reads
            full_num[0, 0, qb] = full
            full_idx[0, 0, qb, :full] = ids[:full]
            partial_num[0, 0, qb] = last + 1 - full
            partial_idx[0, 0, qb, :last + 1 - full] = ids[full:last + 1]
        base = torch.tensor([first], dtype=torch.int32)

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            logical = p2l[b, kv_idx // bs] * bs + kv_idx % bs
            return logical <= base[b] + q_idx

        return BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=(qb_size, bs),
                                        mask_mod=mask_mod, seq_lengths=(width, n * bs), compute_q_blocks=False)

    # -- warm-up ------------------------------------------------------------------------------
    def warm(self, pool_k: torch.Tensor, pool_v: torch.Tensor, scale: float, budget_s: float) -> KernelStatus:
        """Compile every bucket's shape by running it once over the pool (read only), most used
        first (decode groups, then rows), until `budget_s` is spent; then `warmed`: a shape left
        over, or any other, raises NotWarmed instead of compiling (its calls take the gather path)."""
        started = time.monotonic()
        gen = torch.Generator().manual_seed(0)
        capacity = self.num_blocks * self.block_size
        length = min(capacity, 3 * self.block_size + 1)
        table = list(range(-(-length // self.block_size)))
        shapes: list[Callable[[], object]] = []
        for width in self.decode_buckets:
            q = torch.randn(width, self.q_heads, self.head_dim, generator=gen).to(self.dtype)
            shapes.append(lambda q=q, width=width: self.decode(pool_k, pool_v, q, [table] * width, [length] * width,
                                                                scale))
        if self.rows_in_place:
            for width in ROW_BUCKETS:
                rows = min(width, capacity)
                q = torch.randn(rows, self.q_heads, self.head_dim, generator=gen).to(self.dtype)
                shapes.append(lambda q=q, rows=rows: self.rows(pool_k, pool_v, q,
                                                               list(range(-(-rows // self.block_size))), 0, scale))
        done = 0
        with torch.inference_mode():  # as the steps run (the compiled graph is guarded on it)
            for shape in shapes:
                if done and time.monotonic() - started > budget_s:
                    break
                shape()
                done += 1
        self.warmed = True
        took = round(time.monotonic() - started, 3)
        left = len(shapes) - done
        why = "compiled flex_attention over the pool's blocks" + (
            f"; {left} of {len(shapes)} shapes not compiled within {budget_s:g}s (their calls gather)" if left else "")
        return KernelStatus("in_place", why, took, done)
