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
