"""A CPU rank's decode attention over its paged KV pool in place: a C++ kernel
(`paged_decode.cpp`, beside this file) built once per machine at warm-up and called through
ctypes (issue 52, item 2: "or a kernel of equal effect").

Why: the gather path (service.parallel.kv_cache.gather_attention) copies every session's
blocks, `pool[tables]` padded to the widest table, before attention: per one-row append it
reads the pool, writes the copy and reads the copy again (about 3x the session's K/V bytes).
This kernel reads each session's blocks where they lie, once. It replaced torch's compiled
`flex_attention` with a paged block mask, which read the pages at 7-8 GB/s where this machine
streams 25-31 GB/s, paid dynamo's guards on every call (~0.2 ms x layers), needed a compiled
shape per group width (23-26 s at bring-up with a cold inductor cache) and its own masks per
step (bench/NOTES.md, "A hand-written CPU decode kernel").

Math (exactly the gather path's): one decode step holds S one-row appends; row i sits at
position lengths[i] - 1 of its session and attends positions 0 .. lengths[i] - 1,
softmax(q K^T * scale) V, query head h reading K/V head h // (h_l / kv_l) (grouped-query
attention). The C++ file's header states the kernel's scheme: the pages of every session of
the step are cut into chunks shared among the threads, each chunk reads a token's K row once
for every head (an online softmax over pages), and a session's chunks are merged by their
maxima. Accumulation is in float32 for every dtype (float32, bfloat16, float16).

Which rows: one-row appends (decode) read in place: there the gather's copy is the cost.
Appends of several rows (prefill chunks, recomputes, multi-row appends) gather: the copy is 1/n
of their work per row, and torch's fused SDPA over the copy is a tuned kernel (against the
compiled flex_attention rows kernel this module held before: 92 ms gathered, 185 ms in place for
100 rows at context 1500; bench/NOTES.md).

The build: service.parallel.native (once per machine, ~1 s, bounded by the warm-up's budget; a
later process loads the library in milliseconds). `InPlaceAttention.warm` then checks the
kernel against a reference on a scratch pool before a rank uses it.

CUDA: not used (a CUDA rank in bf16/fp16 reads its pool through varlen_attn instead:
service.parallel.paged_varlen); `compiler_problem` says so.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from service.parallel.native import compiler_problem as native_compiler_problem, load

SOURCE = "paged_decode.cpp"  # beside service.parallel.native
# The build's bound when a kernel that was never warmed is called (a test's or a bench's; a rank
# always warms first, within tunables.gang.session_compile_budget_s).
UNWARMED_BUILD_BUDGET_S = 600.0
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # paged_decode.cpp's `dtype`
# Chunks of a step's pages per thread, and a chunk's fewest pages: enough chunks that a thread
# finishing early takes another (sessions differ in length), few enough that merging stays small.
CHUNKS_PER_THREAD = 4
MIN_CHUNK_PAGES = 4
# The warm-up's check against a float64 reference on a scratch pool: the largest |difference|
# relative to the largest |output| (bf16 keeps 8 bits of mantissa, fp16 11).
CHECK_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@dataclass(frozen=True)
class KernelStatus:
    """Which attention a rank's session steps use, and why (GET /gang `sessions.attention`)."""

    # "in_place" (the C++ decode kernel over the pool, CPU) | "varlen" (varlen_attn over the pool's
    # pages, CUDA: service.parallel.paged_varlen) | "gather" (each session's blocks copied)
    path: str
    reason: str  # why this path, in words
    compile_s: float = 0.0  # seconds the warm-up's build (or load) and check took (0: none)
    shapes: int = 0  # checked warm-up steps (in place: the kernel's check; varlen: its steps)

    @property
    def in_place(self) -> bool:
        """Steps read the pool where it lies (no per-step copy of a session's K/V)."""
        return self.path in ("in_place", "varlen")


def compiler_problem(device: torch.device) -> str | None:
    """Why the in-place kernel cannot be built for `device` (None: it can)."""
    if device.type != "cpu":
        return (f"the in-place decode kernel is built and tested for CPU only; {device.type} keeps the gather "
                "path (CUDA in bf16/fp16: service.parallel.paged_varlen)")
    return native_compiler_problem()


_entry: ctypes._CFuncPtr | None = None  # the kernel's typed entry point, once loaded


def load_library(budget_s: float) -> ctypes._CFuncPtr:
    """The kernel's entry point in this process, typed (service.parallel.native: the library
    built once per machine, bounded by `budget_s`)."""
    global _entry
    if _entry is None:
        fn = load(SOURCE, budget_s).gangserve_paged_decode
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 6, *[ctypes.c_int64] * 6, ctypes.c_float, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int64]
        _entry = fn
    return _entry


@dataclass(frozen=True)
class KernelShape:
    """What one rank's in-place attention serves: the pool's pages (num_blocks x block_size),
    its K/V heads, the query heads reading it, the head width and the dtype. Every peer of a gang
    has the same (heads split evenly); a warm spare warms its gang's shape before it is adopted
    (`compile_shape`, service.gang.spare), so the adopting rebuild loads nothing new."""

    num_blocks: int
    block_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


def compile_shape(shape: KernelShape, budget_s: float) -> KernelStatus:
    """Build (or load) and check `shape`'s kernel in this process, at most `budget_s` of
    building (InPlaceAttention.warm)."""
    kernel = InPlaceAttention(shape.num_blocks, shape.block_size, shape.q_heads, shape.kv_heads, shape.head_dim,
                              shape.dtype)
    return kernel.warm(budget_s)


@dataclass(frozen=True)
class _StepTables:
    """One decode step's block tables as the kernel reads them (built once for all its layers):
    the tables concatenated, where each session's starts, the lengths, and the chunk size."""

    tables: torch.Tensor  # [sum of table lengths] int64
    starts: torch.Tensor  # [S + 1] int64
    lengths: torch.Tensor  # [S] int64
    chunk_pages: int

    @classmethod
    def of(cls, tables: Sequence[Sequence[int]], lengths: Sequence[int], block_size: int,
           threads: int) -> "_StepTables":
        counts = [len(t) for t in tables]
        flat = np.fromiter((b for t in tables for b in t), dtype=np.int64, count=sum(counts))
        starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        pages = sum(-(-n // block_size) for n in lengths)
        chunk = max(MIN_CHUNK_PAGES, -(-pages // (threads * CHUNKS_PER_THREAD)))
        return cls(torch.from_numpy(flat), torch.from_numpy(starts),
                   torch.tensor(list(lengths), dtype=torch.int64), chunk)


class InPlaceAttention:
    """The in-place decode attention for one pool: its pages (num_blocks x block_size), its K/V
    heads, head width and dtype, and the query heads of the model reading it."""

    def __init__(self, num_blocks: int, block_size: int, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        if q_heads % kv_heads:
            raise ValueError(f"query heads ({q_heads}) must be a multiple of the pool's K/V heads ({kv_heads})")
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"the in-place kernel serves {', '.join(map(str, _DTYPE_CODES))}, not {dtype}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.q_heads, self.kv_heads, self.head_dim, self.dtype = q_heads, kv_heads, head_dim, dtype
        self._plan: object | None = None  # the step whose tables `_step` holds
        self._step: _StepTables | None = None

    @property
    def shape(self) -> KernelShape:
        return KernelShape(self.num_blocks, self.block_size, self.q_heads, self.kv_heads, self.head_dim, self.dtype)

    def matches(self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        return (q_heads, kv_heads, head_dim, dtype) == (self.q_heads, self.kv_heads, self.head_dim, self.dtype)

    def _tables(self, plan: object | None, tables: Sequence[Sequence[int]], lengths: Sequence[int]) -> _StepTables:
        """The step's tables, built for its first layer only: every cached layer of a step passes
        the same plan (the same object)."""
        if plan is None or self._plan is not plan:
            self._step = _StepTables.of(tables, lengths, self.block_size, torch.get_num_threads())
            self._plan = plan
        assert self._step is not None
        return self._step

    def decode(self, pool_k: torch.Tensor, pool_v: torch.Tensor, q: torch.Tensor, tables: Sequence[Sequence[int]],
               lengths: Sequence[int], scale: float, plan: object | None = None) -> torch.Tensor:
        """q [S, h_l, d] (row i at position lengths[i] - 1 of the session whose table is
        tables[i]) over one layer of the pool, pool_k / pool_v [num_blocks, B, kv_l, d] ->
        ctx [S, h_l, d]. `plan`: the step's, to build its tables once for all layers. The
        library is loaded on the first call if `warm` did not (a test's kernel; a rank warms)."""
        expected = (self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
        if tuple(pool_k.shape) != expected or pool_v.shape != pool_k.shape:
            raise ValueError(f"pool layers of shape {expected} expected, got {tuple(pool_k.shape)} and "
                             f"{tuple(pool_v.shape)}")
        if not (pool_k.dtype == pool_v.dtype == q.dtype == self.dtype and pool_k.is_contiguous()
                and pool_v.is_contiguous() and pool_k.device.type == "cpu"):
            raise ValueError(f"contiguous CPU pool layers and queries of {self.dtype} expected, got "
                             f"{pool_k.dtype}/{pool_v.dtype}/{q.dtype} on {pool_k.device}")
        if q.dim() != 3 or q.shape[1:] != (self.q_heads, self.head_dim) or \
                not q.shape[0] == len(tables) == len(lengths):
            raise ValueError(f"q [S, {self.q_heads}, {self.head_dim}] with S tables and lengths expected, got "
                             f"{tuple(q.shape)}, {len(tables)} tables, {len(lengths)} lengths")
        kernel = load_library(UNWARMED_BUILD_BUDGET_S)
        step = self._tables(plan, tables, lengths)
        q = q.contiguous()
        out = torch.empty_like(q)
        failed = kernel(
            _DTYPE_CODES[self.dtype], q.data_ptr(), pool_k.data_ptr(), pool_v.data_ptr(), step.tables.data_ptr(),
            step.starts.data_ptr(), step.lengths.data_ptr(), q.shape[0], self.q_heads, self.kv_heads, self.head_dim,
            self.block_size, self.num_blocks, scale, out.data_ptr(), torch.get_num_threads(), step.chunk_pages)
        if failed:
            raise ValueError(f"the decode kernel refused its step: {len(tables)} sessions of lengths "
                             f"{list(lengths)[:8]} over tables of {[len(t) for t in tables][:8]} blocks in a pool of "
                             f"{self.num_blocks} blocks of {self.block_size}")
        return out

    def warm(self, budget_s: float) -> KernelStatus:
        """Load the library (building it within `budget_s` if this machine has none), then check
        it: one decode step over a scratch pool of this kernel's heads, head width and dtype
        (three sessions of 1, B + 3 and 3B positions, pages out of order), against a float64
        reference computed from the same inputs with plain torch. KernelStatus("in_place") when
        they agree within CHECK_TOLERANCE, "gather" with the difference otherwise; BuildFailed
        when the library cannot be built or loaded."""
        started = time.monotonic()
        load_library(budget_s)
        b, h, kv, d = self.block_size, self.q_heads, self.kv_heads, self.head_dim
        gen = torch.Generator().manual_seed(0)
        lengths = [1, b + 3, 3 * b]
        tables = [[4], [2, 0], [1, 3, 5]]
        scratch_k, scratch_v = (torch.randn(6, b, kv, d, generator=gen).to(self.dtype) for _ in range(2))
        q = torch.randn(len(lengths), h, d, generator=gen).to(self.dtype)
        scale = d ** -0.5
        got = InPlaceAttention(6, b, h, kv, d, self.dtype).decode(scratch_k, scratch_v, q, tables, lengths, scale)
        error = 0.0
        for i, (table, n) in enumerate(zip(tables, lengths)):
            keys, vals = (pages[table].reshape(-1, kv, d)[:n].double().repeat_interleave(h // kv, dim=1)
                          for pages in (scratch_k, scratch_v))  # [n, h, d]
            weights = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), keys) * scale, dim=-1)
            want = torch.einsum("hn,nhd->hd", weights, vals)
            error = max(error, float((got[i].double() - want).abs().max() / want.abs().max().clamp_min(1e-6)))
        took = round(time.monotonic() - started, 3)
        tolerance = CHECK_TOLERANCE[self.dtype]
        if not error <= tolerance:
            return KernelStatus("gather", f"the in-place decode kernel disagreed with its reference at warm-up: max "
                                          f"|difference| {error:.2e} of the largest output (at most {tolerance:g})",
                                took)
        return KernelStatus("in_place", f"the C++ decode kernel reads the pool's blocks in place (checked at warm-up, "
                                        f"max |difference| {error:.1e}); appends of several rows gather", took, 1)
