"""The gang's sequencer (service.gang.sequencer): its deadlines, measured from a step's real
start, and one wake of the event loop per step (no Ray: real threads, a real event loop).

Bounds are one-sided where the machine's load can only make a wake late: an error comes no
earlier than its deadline (minus the clock's grain) and within a loose margin after it."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import pytest

from service.contract.errors import CollectiveTimeout, DeadlineExceeded, DeadlineExceededBeforeStep
from service.gang.sequencer import Sequencer

pytestmark = pytest.mark.unit

GRAIN_S = 0.01  # a timer may fire this early (uvloop counts in ms), never more
LATE_S = 1.5  # a wake on this shared 2-core machine may come this late


class Stuck:
    """Records `on_stuck`'s reasons, with when each came."""

    def __init__(self) -> None:
        self.reasons: list[tuple[float, str]] = []

    def __call__(self, reason: str) -> None:
        self.reasons.append((time.monotonic(), reason))


def blocking(seconds: float, started: list[float] | None = None) -> Callable[[], str]:
    """A step that takes `seconds` on the sequencer thread (and notes its start)."""
    def step() -> str:
        if started is not None:
            started.append(time.monotonic())
        time.sleep(seconds)
        return f"slept {seconds}"
    return step


def test_a_step_returns_its_result_with_one_wake_of_the_loop() -> None:
    """Each step with a step timeout (and a request deadline) wakes the loop once: the result's."""
    async def main() -> tuple[list[str], int]:
        loop = asyncio.get_running_loop()
        wakes = 0
        threadsafe = loop.call_soon_threadsafe

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal wakes
            wakes += 1
            return threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        seq = Sequencer(on_stuck=Stuck())
        try:
            out = [await seq.run(lambda i=i: f"step {i}", step_timeout_s=30.0,
                                 request_deadline=time.monotonic() + 30.0) for i in range(50)]
        finally:
            seq.shutdown()
        return out, wakes

    out, wakes = asyncio.run(main())
    assert out == [f"step {i}" for i in range(50)]
    assert wakes == 50, f"expected one loop wake per step (50), counted {wakes}"


def test_a_stuck_step_times_out_from_its_real_start_not_from_its_submission() -> None:
    """A step queued 0.6 s behind another, then stuck: CollectiveTimeout and on_stuck at its own
    start + step_timeout_s (0.4 s), not at submission + 0.4 s."""
    async def main() -> tuple[float, float, list[float], Stuck, BaseException | None]:
        stuck, release = Stuck(), threading.Event()
        seq = Sequencer(on_stuck=stuck)
        started: list[float] = []
        first = asyncio.ensure_future(seq.run(blocking(0.6), step_timeout_s=30.0))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        error: BaseException | None = None

        def stuck_step() -> None:
            started.append(time.monotonic())
            release.wait(10.0)

        try:
            await seq.run(stuck_step, step_timeout_s=0.4)
        except CollectiveTimeout as exc:
            error = exc
        t1 = time.monotonic()
        release.set()
        await first
        seq.shutdown()
        return t0, t1, started, stuck, error

    t0, t1, started, stuck, error = asyncio.run(main())
    assert isinstance(error, CollectiveTimeout) and "collective_timeout_s=0.4" in str(error), error
    assert len(started) == 1 and started[0] - t0 >= 0.5, ("the stuck step should start after the first", started, t0)
    assert started[0] + 0.4 - GRAIN_S <= t1 <= started[0] + 0.4 + LATE_S, (
        f"timed out {t1 - started[0]:.3f}s after its start; expected 0.4 s")
    assert len(stuck.reasons) == 1 and "collective_timeout_s=0.4" in stuck.reasons[0][1], stuck.reasons


def test_queued_time_is_not_the_steps_own() -> None:
    """A step queued longer than its step_timeout_s, then quick, succeeds (nothing marked stuck)."""
    async def main() -> tuple[str, Stuck]:
        stuck = Stuck()
        seq = Sequencer(on_stuck=stuck)
        first = asyncio.ensure_future(seq.run(blocking(0.8), step_timeout_s=30.0))
        await asyncio.sleep(0.05)
        out = await seq.run(blocking(0.1), step_timeout_s=0.5)
        await first
        seq.shutdown()
        return out, stuck

    out, stuck = asyncio.run(main())
    assert out == "slept 0.1"
    assert stuck.reasons == []


def test_a_request_deadline_while_queued_drops_the_step_uncomputed_at_the_deadline() -> None:
    async def main() -> tuple[float, float, list[float], BaseException | None]:
        seq = Sequencer(on_stuck=Stuck())
        first = asyncio.ensure_future(seq.run(blocking(1.0), step_timeout_s=30.0))
        await asyncio.sleep(0.05)
        ran: list[float] = []
        deadline = time.monotonic() + 0.3
        error: BaseException | None = None
        try:
            await seq.run(blocking(0.0, ran), step_timeout_s=30.0, request_deadline=deadline)
        except DeadlineExceededBeforeStep as exc:
            error = exc
        t1 = time.monotonic()
        await first
        await asyncio.sleep(0.1)  # had it not been dropped, it would run now
        seq.shutdown()
        return deadline, t1, ran, error

    deadline, t1, ran, error = asyncio.run(main())
    assert isinstance(error, DeadlineExceededBeforeStep) and "not computed" in str(error), error
    assert deadline - GRAIN_S <= t1 <= deadline + LATE_S, f"answered {t1 - deadline:+.3f}s from the deadline"
    assert ran == [], "a step dropped at its request's deadline must not run"


def test_a_request_deadline_while_computing_answers_then_the_watch_still_finds_it_stuck() -> None:
    """Started, then past the request's deadline: DeadlineExceeded at the deadline (the gang not
    blamed); the step, still stuck at start + step_timeout_s, is reported to on_stuck then."""
    async def main() -> tuple[float, float, list[float], Stuck, BaseException | None]:
        stuck, release = Stuck(), threading.Event()
        seq = Sequencer(on_stuck=stuck)
        started: list[float] = []

        def stuck_step() -> None:
            started.append(time.monotonic())
            release.wait(10.0)

        deadline = time.monotonic() + 0.2
        error: BaseException | None = None
        try:
            await seq.run(stuck_step, step_timeout_s=0.6, request_deadline=deadline)
        except DeadlineExceeded as exc:
            error = exc
        t1 = time.monotonic()
        assert stuck.reasons == [], "a request's deadline is not the gang's fault"
        while not stuck.reasons and time.monotonic() < started[0] + 0.6 + LATE_S:
            await asyncio.sleep(0.02)
        release.set()
        seq.shutdown()
        return deadline, t1, started, stuck, error

    deadline, t1, started, stuck, error = asyncio.run(main())
    assert type(error) is DeadlineExceeded, error
    assert deadline - GRAIN_S <= t1 <= deadline + LATE_S, f"answered {t1 - deadline:+.3f}s from the deadline"
    assert len(stuck.reasons) == 1, stuck.reasons
    when, reason = stuck.reasons[0]
    assert "collective_timeout_s=0.6" in reason
    assert started[0] + 0.6 - GRAIN_S <= when <= started[0] + 0.6 + LATE_S, (
        f"reported stuck {when - started[0]:.3f}s after its start; expected 0.6 s")


def test_a_steps_own_error_reaches_the_caller() -> None:
    async def main() -> BaseException | None:
        seq = Sequencer(on_stuck=Stuck())

        def failing() -> None:
            raise ValueError("the rank refused: expected weights version 3, found 2")

        try:
            await seq.run(failing, step_timeout_s=30.0)
        except ValueError as exc:
            return exc
        finally:
            seq.shutdown()
        return None

    error = asyncio.run(main())
    assert isinstance(error, ValueError) and "expected weights version 3" in str(error)
