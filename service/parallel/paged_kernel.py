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

The build (`load_library`): the system's C++ compiler ($CXX, else g++, c++ or clang++ on PATH:
`compiler_problem`) in child processes bounded by the warm-up's budget, `-O3 -march=native
-ffast-math -fopenmp` (COMPILE_FLAGS says why the link goes without it), into a per-user cache
directory under a name that hashes the source, the flags, the compiler and the CPU's feature
flags; written to a temporary name and renamed into place, so
ranks building at once on one node never wait on a lock (torch's `load_inline` waits on its
lock file without a bound: a rank killed mid-build would hang every later one) and a later
process loads the file in milliseconds. The library links `libgomp.so.1`, the soname torch's
own OpenMP runtime carries, so the process keeps one OpenMP runtime. `InPlaceAttention.warm`
then checks the kernel against a reference on a scratch pool before a rank uses it.

CUDA: not used (a CUDA rank in bf16/fp16 reads its pool through varlen_attn instead:
service.parallel.paged_varlen); `compiler_problem` says so.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

SOURCE = Path(__file__).with_name("paged_decode.cpp")
# Compiled with -ffast-math (the reductions and exp vectorised; the kernel keeps its arithmetic
# finite), linked without it: linking with it adds crtfastmath.o, whose constructor sets the CPU's
# flush-to-zero mode for the whole process when the library loads, and every torch op after it
# would lose denormals.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
COMPILER_ENV = "CXX"  # the compiler to use, if set
COMPILERS = ("g++", "c++", "clang++")  # else the first of these on PATH
KERNEL_DIR_ENV = "GANGSERVE_KERNEL_DIR"  # where built kernels are kept (default: a per-user temp dir)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # paged_decode.cpp's `dtype`
# Chunks of a step's pages per thread, and a chunk's fewest pages: enough chunks that a thread
# finishing early takes another (sessions differ in length), few enough that merging stays small.
CHUNKS_PER_THREAD = 4
MIN_CHUNK_PAGES = 4
# The warm-up's check against a float64 reference on a scratch pool: the largest |difference|
# relative to the largest |output| (bf16 keeps 8 bits of mantissa, fp16 11).
CHECK_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


class BuildFailed(RuntimeError):
    """The kernel could not be built or loaded on this machine (the rank keeps the gather path)."""


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
    try:
        _compiler()
    except Exception as exc:  # noqa: BLE001 - any failure to find one means: no compiler
        return f"no C++ compiler for the in-place kernel ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    return None


def _compiler() -> str:
    """The C++ compiler's full path: $CXX if set, else the first of COMPILERS on PATH."""
    wanted = os.environ.get(COMPILER_ENV)
    for name in [wanted] if wanted else COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(f"$CXX={wanted!r} is not on PATH" if wanted else f"none of {', '.join(COMPILERS)} on PATH")


def _kernel_dir() -> Path:
    """The cache of built kernels: $GANGSERVE_KERNEL_DIR, else <tmp>/gangserve_kernels_<uid>; a
    directory another user owns is not trusted (a private temporary one is used instead)."""
    configured = os.environ.get(KERNEL_DIR_ENV)
    path = Path(configured) if configured else Path(tempfile.gettempdir()) / f"gangserve_kernels_{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        return Path(tempfile.mkdtemp(prefix="gangserve_kernels_"))
    return path


def _cpu_flags() -> str:
    """This CPU's feature flags (`-march=native` builds for them): part of the cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


_library: ctypes.CDLL | None = None


def load_library(budget_s: float) -> ctypes.CDLL:
    """The kernel's library in this process, built first if this machine has none cached, the
    build bounded by `budget_s` (module docstring); BuildFailed says what failed."""
    global _library
    if _library is not None:
        return _library
    compiler = _compiler()
    source = SOURCE.read_bytes()
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS).encode()
    key = hashlib.sha256(b"\0".join([source, flags, compiler.encode(), _cpu_flags().encode(),
                                     platform.machine().encode()])).hexdigest()[:20]
    directory = _kernel_dir()
    target = directory / f"paged_decode_{key}.so"
    if not target.exists():
        _build(compiler, directory, target, max(budget_s, 1.0))
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        raise BuildFailed(f"could not load the built kernel {target}: {exc}") from exc
    fn = library.gangserve_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 6, *[ctypes.c_int64] * 6, ctypes.c_float, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int64]
    _library = library
    return library


def _build(compiler: str, directory: Path, target: Path, budget_s: float) -> None:
    """Compile SOURCE into `target` (compile, then link: see COMPILE_FLAGS), into temporary names
    first, then renamed into place (a rank building beside this one renames the same bytes). Each
    step runs in a process group of its own, killed whole when `budget_s` is spent: killing the
    driver alone would leave its cc1plus holding the pipe, and reading it would wait for it."""
    deadline = time.monotonic() + budget_s
    fd, partial = tempfile.mkstemp(dir=directory, prefix=target.name, suffix=".partial")
    os.close(fd)
    objects = partial + ".o"
    try:
        _run_step([compiler, *COMPILE_FLAGS, str(SOURCE), "-o", objects], deadline, budget_s)
        _run_step([compiler, *LINK_FLAGS, objects, "-o", partial], deadline, budget_s)
        os.replace(partial, target)
    except OSError as exc:
        raise BuildFailed(f"could not run {compiler} into {directory}: {exc}") from exc
    finally:
        Path(partial).unlink(missing_ok=True)
        Path(objects).unlink(missing_ok=True)


def _run_step(command: list[str], deadline: float, budget_s: float) -> None:
    """One compiler call, bounded by `deadline` (BuildFailed naming its error line or the budget)."""
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        _, errors = child.communicate(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate(timeout=10)
        raise BuildFailed(f"building {SOURCE.name} took more than {budget_s:g}s "
                          "(tunables.gang.session_compile_budget_s)") from None
    if child.returncode != 0:
        first = next((line for line in errors.splitlines() if "error" in line), errors.strip())
        raise BuildFailed(f"{command[0]} failed to build {SOURCE.name} (exit {child.returncode}): {first[:200]}")


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
        library = load_library(budget_s=600.0)
        step = self._tables(plan, tables, lengths)
        q = q.contiguous()
        out = torch.empty_like(q)
        failed = library.gangserve_paged_decode(
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
