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
import threading
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
        """Run fn(*args) on the sequencer thread and return its result (see the module doc).

        One wake of the event loop per step: the result's (`wrap_future`). The thread writes
        its start stamp into a `_Start` the loop reads when its own timer fires; it wakes the
        loop at the start only once the loop asked, which the loop does when a timer found the
        work still queued. The first timer needs no stamp: work submitted at `t` starts at
        `s >= t`, so it cannot be stuck before `t + step_timeout_s <= s + step_timeout_s`.
        The timer fires at the earlier of that bound and the request's deadline; from then on
        every deadline is measured from the real start `s`, as if the loop had been told of it
        at once."""
        loop = asyncio.get_running_loop()
        start = _Start()

        def timed() -> T:
            if request_deadline is not None and time.monotonic() >= request_deadline:
                raise DeadlineExceededBeforeStep(
                    "the request's deadline passed while it waited for the gang's sequencer; it was not computed")
            start.stamp()
            return fn(*args)

        work: Future[T] = self._thread.submit(timed)
        result = asyncio.wrap_future(work)
        if step_timeout_s is None:
            return await result
        try:
            started_at = await self._until_started(loop, work, result, start, step_timeout_s, request_deadline)
            if started_at is None:  # finished (or failed) before any timer of ours fired
                return await result
            remaining = step_timeout_s - (time.monotonic() - started_at)
            if request_deadline is not None and request_deadline - time.monotonic() < remaining:
                try:
                    return await asyncio.wait_for(asyncio.shield(result),
                                                  timeout=max(0.0, request_deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    # The step goes on: keep watching it for step_timeout_s (a stuck rank
                    # must still break the gang) without holding up this answer.
                    watcher = loop.create_task(self._watch(result, started_at, step_timeout_s))
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

    @staticmethod
    async def _until_started(loop: asyncio.AbstractEventLoop, work: Future, result: asyncio.Future,
                             start: _Start, step_timeout_s: float, request_deadline: float | None) -> float | None:
        """Waits for the result, or until a timer finds the work started: then its start stamp.

        None: the result arrived first (the common case: one wake, the result's). Raises
        DeadlineExceededBeforeStep when the request's deadline passes while the work is still
        queued (it is dropped uncomputed). While the work is queued with no request deadline
        the wait ends at its start, bounded by the earlier work's own step_timeout_s watch."""
        no_earlier_stuck = time.monotonic() + step_timeout_s  # the first timer (see `run`)
        at_start: asyncio.Future[None] | None = None  # set by the thread once the loop asked
        deadline_passed = False
        while True:
            until = [] if at_start is not None else [no_earlier_stuck]
            if request_deadline is not None and not deadline_passed:
                until.append(request_deadline)
            waits: set[asyncio.Future] = {result} if at_start is None else {result, at_start}
            await asyncio.wait(waits, timeout=max(0.0, min(until) - time.monotonic()) if until else None,
                               return_when=asyncio.FIRST_COMPLETED)
            if result.done():
                return None
            if start.at is not None:
                return start.at
            deadline_passed = request_deadline is not None and time.monotonic() >= request_deadline
            if deadline_passed and work.cancel():
                raise DeadlineExceededBeforeStep(
                    "the request's deadline passed while an earlier gang step ran; it was not computed")
            if at_start is None:
                # A timer found it still queued (or just starting, if the cancel came too
                # late): from now on the thread wakes the loop at its start.
                at_start = loop.create_future()
                at = start.wake_me(lambda f=at_start: loop.call_soon_threadsafe(_set_if_pending, f, None))
                if at is not None:
                    return at

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


class _Start:
    """A step's start, stamped by the sequencer thread (time.monotonic()) and read by the loop
    without waking it. `wake_me` asks the thread to wake the loop at the start; the lock
    makes "not started yet, wake me" and the thread's stamp one order: either the loop sees
    the stamp, or the thread sees the request and calls it."""

    __slots__ = ("_lock", "_at", "_wake")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: float | None = None
        self._wake: Callable[[], None] | None = None

    @property
    def at(self) -> float | None:
        return self._at

    def stamp(self) -> None:
        """On the sequencer thread, just before the work runs."""
        with self._lock:
            self._at = time.monotonic()
            wake = self._wake
        if wake is not None:
            wake()

    def wake_me(self, wake: Callable[[], None]) -> float | None:
        """On the loop: wake() at the start, unless it already started (then its stamp, and
        wake is never called)."""
        with self._lock:
            if self._at is None:
                self._wake = wake
            return self._at
