"""The gang's sequencer: one thread, so every rank sees one global order of collectives.

Every operation that touches the ranks (bring-up, a step, a weights swap, a liveness probe,
a heartbeat, teardown) runs on this thread, one at a time. `run` is how the event loop hands
it work, with the two deadlines a step has:

- the gang's own: `step_timeout_s` counts from the moment the work *starts* (time queued
  behind earlier steps is not the gang's fault). Past it `on_stuck(reason)` is told (the
  gang marks itself BROKEN) and the caller gets CollectiveTimeout (504), while the stuck
  thread waits out the process group's own timeout;
- the request's: `request_deadline` (time.monotonic()). Work is never started after it
  (DeadlineExceededBeforeStep, raised at the deadline even while the thread is busy with an
  earlier step), and once started the caller stops waiting at it (DeadlineExceeded; the gang
  is not blamed, the work finishes on its own and is still watched for `step_timeout_s`).
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from service.contract.errors import CollectiveTimeout, DeadlineExceeded, DeadlineExceededBeforeStep

T = TypeVar("T")


class Sequencer:
    """A single-thread executor with deadline-aware async submission."""

    def __init__(self, on_stuck: Callable[[str], None]) -> None:
        self._on_stuck = on_stuck  # told when work ran past its step_timeout_s
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gang-sequencer")
        self._watchers: set[asyncio.Task] = set()  # steps past their requests' deadline

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue fn without waiting (RuntimeError once shut down)."""
        return self._thread.submit(fn, *args)

    def shutdown(self) -> None:
        """Drop queued work; the running one (if any) finishes on its own."""
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[..., T], *args: Any, step_timeout_s: float | None = None,
                  request_deadline: float | None = None) -> T:
        """Run fn(*args) on the sequencer thread and return its result (see the module doc)."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future[float] = loop.create_future()

        def timed() -> T:
            if request_deadline is not None and time.monotonic() >= request_deadline:
                raise DeadlineExceededBeforeStep(
                    "the request's deadline passed while it waited for the gang's sequencer; it was not computed")
            loop.call_soon_threadsafe(_set_if_pending, started, time.monotonic())
            return fn(*args)

        work: Future[T] = self._thread.submit(timed)
        result = asyncio.wrap_future(work)
        if step_timeout_s is None:
            return await result
        try:
            until = None if request_deadline is None else max(0.0, request_deadline - time.monotonic())
            await asyncio.wait({started, result}, timeout=until, return_when=asyncio.FIRST_COMPLETED)
            if not started.done() and not result.done():  # still queued at the request's deadline
                if work.cancel():
                    raise DeadlineExceededBeforeStep(
                        "the request's deadline passed while an earlier gang step ran; it was not computed")
                await asyncio.wait({started, result}, return_when=asyncio.FIRST_COMPLETED)  # it just started
            if not started.done():  # finished (or failed) before `started` was delivered
                return await result
            remaining = step_timeout_s - (time.monotonic() - started.result())
            if request_deadline is not None and request_deadline - time.monotonic() < remaining:
                try:
                    return await asyncio.wait_for(asyncio.shield(result),
                                                  timeout=max(0.0, request_deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    # The step goes on: keep watching it for step_timeout_s (a stuck rank
                    # must still break the gang) without holding up this answer.
                    watcher = loop.create_task(self._watch(result, started.result(), step_timeout_s))
                    self._watchers.add(watcher)
                    watcher.add_done_callback(self._watchers.discard)
                    raise DeadlineExceeded(
                        "the request's deadline passed while the gang was computing it") from None
            return await asyncio.wait_for(asyncio.shield(result), timeout=max(0.0, remaining))
        except asyncio.TimeoutError:
            self._on_stuck(f"a step exceeded collective_timeout_s={step_timeout_s:.1f}s (stuck rank?)")
            raise CollectiveTimeout(
                f"the gang did not finish the request within collective_timeout_s={step_timeout_s:.1f}s; "
                "the gang is being rebuilt"
            ) from None
        except asyncio.CancelledError:
            work.cancel()  # drop it if it has not started yet
            raise

    async def _watch(self, result: asyncio.Future, started: float, step_timeout_s: float) -> None:
        """A step nobody waits for any more still breaks the gang past step_timeout_s."""
        try:
            await asyncio.wait_for(asyncio.shield(result),
                                   timeout=max(0.0, step_timeout_s - (time.monotonic() - started)))
        except asyncio.TimeoutError:
            self._on_stuck(f"a step exceeded collective_timeout_s={step_timeout_s:.1f}s (stuck rank?)")
        except BaseException:  # noqa: BLE001 - the step's own failure was handled where it ran
            pass


def _set_if_pending(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)
