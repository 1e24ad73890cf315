"""Torch work off the event loop leaves no OpenMP team behind (service.cluster.own_thread).

A thread that ran a parallel torch op keeps libgomp's worker threads for as long as it lives;
the process's thread count (/proc/self/task) shows them. `in_own_thread` must end with its
thread and its team; a long-lived executor thread (what asyncio.to_thread uses) keeps both,
which is the contrast that shows the count can see a team at all."""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from service.cluster.own_thread import in_own_thread

pytestmark = pytest.mark.unit


def threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_op() -> int:
    """A matmul big enough to run on a team of 2 threads (set in this thread first)."""
    torch.set_num_threads(2)
    (torch.randn(512, 512) @ torch.randn(512, 512)).sum()
    return torch.get_num_threads()


def stable_thread_count(quiet_s: float = 0.3, within_s: float = 5.0) -> int:
    """The thread count once it stayed the same for `quiet_s` (exiting threads take a moment),
    or the last one after `within_s`."""
    deadline = time.monotonic() + within_s
    count, since = threads_now(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = threads_now()
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return count


def test_in_own_thread_leaves_no_thread_and_no_openmp_team() -> None:
    # The process's first parallel op starts one process-wide torch thread (not a team): once.
    asyncio.run(in_own_thread(parallel_op))

    async def scenario() -> None:  # one loop throughout: what a deployment's replica has
        before = stable_thread_count()
        for _ in range(3):
            assert await in_own_thread(parallel_op) == 2
            assert stable_thread_count() == before

    asyncio.run(scenario())

    before = stable_thread_count()
    with ThreadPoolExecutor(max_workers=1) as kept:  # the contrast: a thread that lives on
        assert kept.submit(parallel_op).result() == 2
        # the executor's thread, plus at least one OpenMP worker of its team
        assert stable_thread_count() >= before + 2, (before, threads_now())


def test_in_own_thread_returns_and_raises_like_the_call() -> None:
    async def scenario() -> None:
        assert await in_own_thread(divmod, 7, 2) == (3, 1)
        with pytest.raises(ZeroDivisionError):
            await in_own_thread(divmod, 1, 0)

    asyncio.run(scenario())
