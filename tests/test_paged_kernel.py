"""The in-place attention's guards (service.parallel.paged_kernel, issue 52 item 2): a machine
without a C++ compiler, or a non-CPU device, keeps the gather path and says why; after warm-up a
shape that was not compiled takes the gather path for that call and is never compiled then.
Parity of the kernel itself: tests/test_sessions.py (unit), tests/test_models.py and
tests/test_llama.py (spawned gangs of 1, 2 and 4), the served path: tests/test_sessions.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from service.gang.worker import PlainModel, Rank
from service.parallel.kv_cache import AppendPlan, PagedKVPool, gather_attention, paged_attention
from service.parallel.paged_kernel import InPlaceAttention, compiler_problem

pytestmark = pytest.mark.unit


NO_COMPILER = {"cpp.cxx": ("no-such-c++-compiler",)}  # inductor finds none of these


def test_without_a_cpp_compiler_or_on_a_gpu_the_reason_is_named() -> None:
    import torch._inductor.config as inductor

    assert compiler_problem(torch.device("cpu")) is None  # this machine has one
    with inductor.patch(NO_COMPILER):
        why = compiler_problem(torch.device("cpu"))
    assert why is not None and why.startswith("no C++ compiler for torch.compile on CPU"), why
    assert "CPU only" in (compiler_problem(torch.device("cuda", 0)) or "")


def test_a_rank_without_a_compiler_warms_up_to_the_gather_path() -> None:
    """Rank.warm_sessions allocates the pool of the sessions' shape and, with no compiler (or
    tunables.gang.session_attention=gather), attaches no kernel and says why."""
    import torch._inductor.config as inductor

    rank = Rank(0, 1, device=torch.device("cpu"), node_ip="127.0.0.1")
    rank.rendezvous("127.0.0.1", 0, "gloo", 10)
    rank.load_weights(PlainModel(embed_dim=64, num_heads=4, init="random"), 1)
    status = rank.warm_sessions(8, 16, "gather", 10)
    assert (status.path, status.reason) == ("gather", "tunables.gang.session_attention is 'gather'")
    assert rank.kv_pool is not None and rank.kv_pool.attention is None and rank.kv_pool_bytes() == 2 * 8 * 16 * 64 * 4
    with inductor.patch(NO_COMPILER):
        status = rank.warm_sessions(8, 16, "auto", 10)
    assert status.path == "gather" and "no C++ compiler" in status.reason and rank.session_attention == status
    assert rank.kv_pool.attention is None
    rank.close()


def test_a_shape_not_compiled_at_warm_up_gathers_and_is_never_compiled() -> None:
    """A kernel marked warmed whose shapes were never compiled: every call falls back to the
    gather path (the same answer), and dynamo compiles nothing."""
    from torch._dynamo.utils import counters

    pool = PagedKVPool(24, 4, 2, 8, torch.float32, torch.device("cpu"))
    pool.attention = kernel = InPlaceAttention(24, 4, 4, 2, 8, torch.float32)  # grouped-query: 4 over 2
    kernel.warmed = True  # as after warm-up, but nothing of this shape was compiled
    gen = torch.Generator().manual_seed(0)
    plan = AppendPlan(24, 4, (5, 1), (0, 0), ((3, 7), (9,)))
    q, k, v = torch.randn(6, 4, 8, generator=gen), torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    before = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        got = paged_attention(pool, 0, q, k, v, plan, 8 ** -0.5)
        want = gather_attention(pool.k[0], pool.v[0], q, plan, 8 ** -0.5)
    assert counters["stats"]["unique_graphs"] == before
    assert torch.equal(got, want)
    assert np.isfinite(got.numpy()).all()


def _dense_last_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64, torch's own SDPA: the last row of causal attention over one session's whole
    sequence (q [h, d] at the last position; k, v [L, kv, d], each K/V head read by h / kv query
    heads) -> [h, d]."""
    h, kv = q.shape[0], k.shape[1]
    keys = k.double().transpose(0, 1).repeat_interleave(h // kv, dim=0)  # [h, L, d]
    vals = v.double().transpose(0, 1).repeat_interleave(h // kv, dim=0)
    return torch.nn.functional.scaled_dot_product_attention(q.double()[:, None], keys, vals, scale=scale)[:, 0]


@pytest.mark.parametrize("path", ["gather", "in-place"])
@pytest.mark.parametrize("heads", [(4, 4), (2, 1)], ids=["ws1-4-heads", "ws2-rank-of-4-over-2-kv-heads"])
@pytest.mark.parametrize("sessions", [1, 2, 3, 5, 17])
def test_a_decode_step_of_s_sessions_matches_dense_causal_attention(path: str, heads: tuple[int, int],
                                                                    sessions: int) -> None:
    """One decode step (S one-row appends, sessions of different lengths over scattered blocks
    of one pool) through `paged_attention` equals torch's SDPA in float64 over each session's
    whole sequence, with S on both sides of where the decode path changes (1 and 2: a call per
    session, paged_kernel.DECODE_ALONE_UP_TO; 3, 5 and 17: one call padded to 4, 8 and 32, the
    sessions' block counts evened by the mask), gathered and in place (the kernel as a rank
    warms it, its decode calls of the shapes warm-up compiled). `heads`: a world-size-1 rank's
    query and K/V heads, and a world-size-2 rank's share of a grouped-query model (what a rank's pool
    holds: the attention of a rank is this function over its heads)."""
    h, kv = heads
    d, bs, num_blocks = 8, 4, 600  # 2,400 pool positions: the CPU decoding template's size (>= 512 per batch entry)
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(sessions)
    pool = PagedKVPool(num_blocks, bs, kv, d, torch.float32, torch.device("cpu"))
    pool.k.normal_(generator=gen)  # other sessions' K/V around them: must never be read
    pool.v.normal_(generator=gen)
    if path == "in-place":
        pool.attention = InPlaceAttention(num_blocks, bs, h, kv, d, torch.float32)
        with torch.inference_mode():
            pool.attention.warm(pool.k[0], pool.v[0], scale, budget_s=600)
    lengths = [37 + 11 * i for i in range(sessions)]  # cached positions: full and partial last blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, seqs = [], []
    for length in lengths:
        table = tuple(order.pop() for _ in range(-(-(length + 1) // bs)))
        tables.append(table)
        seq = [torch.randn(length + 1, n, d, generator=gen) for n in (h, kv, kv)]  # q, k, v of every position
        seqs.append(seq)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)])
        pool.k[0].view(-1, kv, d)[slots] = seq[1][:length]  # the cached positions, as earlier steps wrote them
        pool.v[0].view(-1, kv, d)[slots] = seq[2][:length]
    plan = AppendPlan(num_blocks, bs, (1,) * sessions, tuple(lengths), tuple(tables))
    plan.check()
    q, k, v = (torch.stack([s[j][-1] for s in seqs]) for j in range(3))  # the step's new rows
    with torch.inference_mode():
        got = paged_attention(pool, 0, q, k, v, plan, scale)
        if pool.attention is not None:  # it read in place: the kernel's own call (NotWarmed if not compiled) agrees
            assert torch.equal(got, pool.attention.decode(pool.k[0], pool.v[0], q, tables, [n + 1 for n in lengths],
                                                          scale))
    for i, (qs, ks, vs) in enumerate(seqs):
        want = _dense_last_row(qs[-1], ks, vs, scale)
        err = float((got[i].double() - want).norm() / want.norm())
        assert err <= 1e-5, f"session {i} of {sessions} ({path}, heads {heads}): relative error {err:.3e}"
