"""Blocking torch work off the event loop, on a thread that ends with it.

`asyncio.to_thread` runs on the loop's default executor, whose threads live as long as the
process. A thread that ever ran a parallel torch op keeps an OpenMP team (libgomp's worker
threads) for the rest of its life, and once a process holds more OpenMP threads than it has
CPUs, every team's barriers stop spinning (100 spins instead of ~300,000) and sleep in the
kernel: the rank computing in that process then waits for a futex wake-up of its worker
threads at each of a step's hundreds of parallel regions. The GangServer of a world-size-1
gang (rank 0 on all the cores) met exactly that: hashing the configured `init` weights at start
on the default executor left a second team beside the sequencer's (bench/NOTES.md, the served
one-row decode step).

So weights work in a process that hosts a rank (hashing, checking, copying checkpoints) runs
through `in_own_thread`: its thread, and the team with it, is gone when the call returns.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


async def in_own_thread(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) on a new daemon thread that exits after it; its result, or its exception,
    raised here. Cancelling the caller does not stop fn (as with asyncio.to_thread)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if done.done():  # the caller was cancelled
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the caller's loop
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for the answer
            pass

    threading.Thread(target=run, name=f"own-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await done
