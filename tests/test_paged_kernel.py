"""The in-place decode kernel (service.parallel.paged_kernel, issue 52 item 2): its build is
bounded and names what failed, ranks building at once share one result, a machine without a C++
compiler (or a non-CPU device) keeps the gather path and says why, and a decode step through it
equals torch's SDPA in float64 (float32, bfloat16 and float16; grouped-query heads). Parity
inside the models: tests/test_sessions.py (unit), tests/test_models.py and tests/test_llama.py
(spawned gangs of 1, 2 and 4); the served path: tests/test_sessions.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from service.gang.worker import PlainModel, Rank
from service.parallel.kv_cache import AppendPlan, PagedKVPool, paged_attention
from service.parallel.paged_kernel import InPlaceAttention, compiler_problem

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_without_a_cpp_compiler_or_on_a_gpu_the_reason_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compiler_problem(torch.device("cpu")) is None  # this machine has one
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    why = compiler_problem(torch.device("cpu"))
    assert why == ("no C++ compiler for the native kernels (FileNotFoundError: $CXX='no-such-c++-compiler' is not "
                   "on PATH)"), why
    assert "CPU only" in (compiler_problem(torch.device("cuda", 0)) or "")


def test_a_rank_without_a_compiler_warms_up_to_the_gather_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank.warm_sessions allocates the pool of the sessions' shape and, with no compiler (or
    tunables.gang.session_attention=gather), attaches no kernel and says why; with one, it
    attaches the kernel."""
    rank = Rank(0, 1, device=torch.device("cpu"), node_ip="127.0.0.1")
    rank.rendezvous("127.0.0.1", 0, "gloo", 10)
    rank.load_weights(PlainModel(embed_dim=64, num_heads=4, init="random"), 1)
    status = rank.warm_sessions(8, 16, "gather", 10)
    assert (status.path, status.reason) == ("gather", "tunables.gang.session_attention is 'gather'")
    assert rank.kv_pool is not None and rank.kv_pool.attention is None and rank.kv_pool_bytes() == 2 * 8 * 16 * 64 * 4
    with monkeypatch.context() as env:
        env.setenv("CXX", "no-such-c++-compiler")
        status = rank.warm_sessions(8, 16, "auto", 10)
    assert status.path == "gather" and "no C++ compiler" in status.reason and rank.session_attention == status
    assert rank.kv_pool.attention is None
    status = rank.warm_sessions(8, 16, "auto", 60)
    assert status.path == "in_place" and status.shapes == 1 and isinstance(rank.kv_pool.attention, InPlaceAttention)
    rank.close()


# Each case runs in a fresh interpreter (a process loads the library once and keeps it) with an
# empty kernel directory: the build is what is tested.
_BUILD = textwrap.dedent("""
    import sys, time
    from service.parallel.native import BuildFailed
    from service.parallel.paged_kernel import InPlaceAttention, load_library
    started = time.monotonic()
    try:
        load_library(float(sys.argv[1]))
    except BuildFailed as exc:
        print(f"BuildFailed {time.monotonic() - started:.1f}: {exc}")
    else:
        import torch
        denormal = torch.tensor([1e-39]) * 1.0  # the process's float mode after the load: no flush to zero
        print("built", InPlaceAttention(8, 4, 4, 2, 8, torch.float32).warm(5).path, float(denormal[0]) > 0)
""")


def _build(kernel_dir: Path, budget_s: float, cxx: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "GANGSERVE_KERNEL_DIR": str(kernel_dir), "PYTHONPATH": str(ROOT)}
    env.pop("CXX", None)
    if cxx:
        env["CXX"] = cxx
    return subprocess.Popen([sys.executable, "-c", _BUILD, str(budget_s)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_build_that_fails_or_hangs_is_named_and_bounded(tmp_path: Path) -> None:
    """A compiler that fails: BuildFailed with its error line. A compiler that hangs (and its
    child with it, as cc1plus would): BuildFailed at the budget, not when the child ends. No
    partial file is left, and a rank then keeps the gather path (`warm_sessions`)."""
    failing, hanging = tmp_path / "failing-cxx", tmp_path / "hanging-cxx"
    failing.write_text("#!/bin/sh\necho 'paged_decode.cpp:1:1: error: no such thing' >&2\nexit 3\n")
    hanging.write_text("#!/bin/sh\nsleep 60 &\nsleep 60\n")  # a child in the group holds the pipe too
    for script in (failing, hanging):
        script.chmod(0o755)
    out, _ = _build(tmp_path / "a", 30, str(failing)).communicate(timeout=60)
    assert f"{failing} failed to build paged_decode.cpp (exit 3): paged_decode.cpp:1:1: error: no such thing" \
        in out, out
    out, _ = _build(tmp_path / "b", 2, str(hanging)).communicate(timeout=90)
    assert "BuildFailed" in out and "building paged_decode.cpp took more than 2s" in out, out
    took = float(out.split("BuildFailed ", 1)[1].split(":", 1)[0])  # the build's own seconds, imports apart
    assert 2 <= took < 12, out  # the budget, then the group killed: not the script's 60 s sleep
    assert not list((tmp_path / "a").iterdir()) and not list((tmp_path / "b").iterdir())


def test_ranks_building_at_once_all_load_one_library(tmp_path: Path) -> None:
    """Three processes build into one empty directory at once: each loads a working kernel, one
    library is left and no partial file (each builds under its own name and renames it into
    place; none waits on a lock another could leave behind). Loading it leaves the process's
    floating point alone: a library linked with -ffast-math would set flush-to-zero for every
    op of the process (denormals lost)."""
    children = [_build(tmp_path, 120) for _ in range(3)]
    outs = [child.communicate(timeout=180)[0] for child in children]
    assert all(out.strip().endswith("built in_place True") for out in outs), outs
    left = sorted(f.name for f in tmp_path.iterdir())
    assert len(left) == 1 and left[0].startswith("paged_decode_") and left[0].endswith(".so"), left


def _dense_last_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64, torch's own SDPA: the last row of causal attention over one session's whole
    sequence (q [h, d] at the last position; k, v [L, kv, d], each K/V head read by h / kv query
    heads) -> [h, d]."""
    h, kv = q.shape[0], k.shape[1]
    keys = k.double().transpose(0, 1).repeat_interleave(h // kv, dim=0)  # [h, L, d]
    vals = v.double().transpose(0, 1).repeat_interleave(h // kv, dim=0)
    return torch.nn.functional.scaled_dot_product_attention(q.double()[:, None], keys, vals, scale=scale)[:, 0]


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative, against float64


@pytest.mark.parametrize("path", ["gather", "in-place"])
@pytest.mark.parametrize("heads", [(4, 4), (2, 1), (8, 2)],
                         ids=["ws1-4-heads", "ws2-rank-of-4-over-2-kv-heads", "8-over-2-kv-heads"])
@pytest.mark.parametrize("sessions", [1, 2, 5, 17])
def test_a_decode_step_of_s_sessions_matches_dense_causal_attention(path: str, heads: tuple[int, int],
                                                                    sessions: int) -> None:
    """One decode step (S one-row appends, sessions of different lengths over scattered blocks
    of one pool) through `paged_attention` equals torch's SDPA in float64 over each session's
    whole sequence, gathered and in place (the kernel as a rank warms it; a lone session's pages
    split in chunks among the threads and merged, many sessions sharing the threads). `heads`: a
    world-size-1 rank's query and K/V heads, a world-size-2 rank's share of a grouped-query
    model (what a rank's pool holds: the attention of a rank is this function over its heads),
    and four query heads per K/V head."""
    _check_decode_step(path, heads, sessions, torch.float32)


@pytest.mark.parametrize("heads", [(2, 1), (8, 2), (16, 4), (12, 12)],
                         ids=["2-over-1-kv-head", "8-over-2-kv-heads", "16-over-4-kv-heads", "12-plain-heads"])
@pytest.mark.parametrize("width, block", [(64, 16), (128, 32)], ids=["d64-b16", "d128-b32"])
@pytest.mark.parametrize("sessions", [1, 5])
def test_the_vector_path_s_decode_step_matches_dense_causal_attention(heads: tuple[int, int], width: int, block: int,
                                                                      sessions: int) -> None:
    """Heads of 64 or 128 (grouped or plain) over pages of a multiple of 16 tokens take the kernel's vector path
    (16 tokens scored at once, their lanes summed by one transposing reduction; a partial last
    page reads stale rows into lanes nothing uses): the same float64 reference as above."""
    _check_decode_step("in-place", heads, sessions, torch.float32, width, block)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("width, block", [(8, 4), (64, 16)], ids=["scalar", "vector"])
def test_a_decode_step_in_half_precision_matches_float64_over_the_same_values(dtype: torch.dtype, width: int,
                                                                              block: int) -> None:
    """The kernel reads bfloat16 / float16 pools and accumulates in float32: within the dtype's
    rounding of float64 attention over the same (rounded) values, on both of its paths."""
    _check_decode_step("in-place", (8, 2), 5, dtype, width, block)


def _check_decode_step(path: str, heads: tuple[int, int], sessions: int, dtype: torch.dtype, d: int = 8,
                       bs: int = 4) -> None:
    h, kv = heads
    num_blocks = 600
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(sessions)
    pool = PagedKVPool(num_blocks, bs, kv, d, dtype, torch.device("cpu"))
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))  # other sessions' K/V around them: never read
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    if path == "in-place":
        pool.attention = InPlaceAttention(num_blocks, bs, h, kv, d, dtype)
        assert pool.attention.warm(budget_s=600).path == "in_place"
    lengths = [37 + 11 * i for i in range(sessions)]  # cached positions: full and partial last blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, seqs = [], []
    for length in lengths:
        table = tuple(order.pop() for _ in range(-(-(length + 1) // bs)))
        tables.append(table)
        seq = [torch.randn(length + 1, n, d, generator=gen).to(dtype) for n in (h, kv, kv)]  # every position's q, k, v
        seqs.append(seq)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)])
        pool.k[0].view(-1, kv, d)[slots] = seq[1][:length]  # the cached positions, as earlier steps wrote them
        pool.v[0].view(-1, kv, d)[slots] = seq[2][:length]
    plan = AppendPlan(num_blocks, bs, (1,) * sessions, tuple(lengths), tuple(tables))
    plan.check()
    q, k, v = (torch.stack([s[j][-1] for s in seqs]) for j in range(3))  # the step's new rows
    with torch.inference_mode():
        got = paged_attention(pool, 0, q, k, v, plan, scale)
        if pool.attention is not None:  # it read in place: the kernel's own call is what answered
            assert torch.equal(got, pool.attention.decode(pool.k[0], pool.v[0], q, tables, [n + 1 for n in lengths],
                                                          scale))
    for i, (qs, ks, vs) in enumerate(seqs):
        want = _dense_last_row(qs[-1], ks, vs, scale)
        err = float((got[i].double() - want).norm() / want.norm())
        assert err <= TOLERANCE[dtype], f"session {i} of {sessions} ({path}, {heads}, {dtype}): error {err:.3e}"
