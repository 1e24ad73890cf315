"""Where one request's time went: an ordered timeline of named parts on one clock.

A request crosses three places: the Ingress replica (read, decode, the link to rank 0), the
GangServer replica (the data channel, the batcher, the sequencer thread) and rank 0's step
(broadcast, compute, all_reduce). The parts' names are one enum, `Part`
(service.contract.timing), which Server-Timing, GET /gang's step timings and the step metrics
all read. Each place marks the END of a part, `mark(part)`, on
`time.monotonic_ns()`. CLOCK_MONOTONIC is one clock for every process of a host, so the
GangServer's marks belong on the Ingress's timeline when the two share a node: the data
channel's route, the one that carries them back (service.transport.channel); on any other
route the whole hop is one part, `gang`.

A part's duration is the difference of consecutive marks (the first from `start_ns`), so the
parts add up to the whole by construction: the breakdown can hide nothing, every interval
has a name. Two parts are interleaved in time rather than consecutive: a step's compute and
its all_reduces alternate layer by layer, so the step reports their sums as two marks
(`compute`, then `all_reduce` at the step's end).

How a timeline travels: the request's Timeline is the *current* one of its asyncio task (a
context variable), the way tracing libraries carry a span, so the code between a route and
the wire (the request policy, the link) passes nothing along. A batch step serves several
requests at once and runs in a task of its own, so the batcher gives the step a timeline of
its own (`running_step`), the step's thread fills it, and the batcher copies its marks onto
each member's. The gang's step runner keeps the same timelines of its recent steps for
GET /gang (service.gang.runner): one mark implementation, one set of names.
"""
from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field

from service.contract.timing import Part

# The timeline of the request the running task serves (None: nobody is timing it).
_current: contextvars.ContextVar["Timeline | None"] = contextvars.ContextVar("gangserve_timeline", default=None)
# The timeline of the gang step the running task is about to run (set by the batcher around a step).
_current_step: contextvars.ContextVar["Timeline | None"] = contextvars.ContextVar("gangserve_step", default=None)


@dataclass
class Timeline:
    """One request's (or one step's) parts: (part, monotonic ns at its end), in the order they ended."""

    start_ns: int
    marks: list[tuple[Part, int]] = field(default_factory=list)

    @classmethod
    def starting_now(cls) -> "Timeline":
        return cls(time.monotonic_ns())

    def mark(self, part: Part, at_ns: int | None = None) -> None:
        """`part` ended now (or at `at_ns`, a monotonic_ns taken on this host). A name that is
        not a Part's is refused (ValueError): every part has its one name in the enum."""
        self.marks.append((Part(part), time.monotonic_ns() if at_ns is None else at_ns))

    def extend(self, marks: list[tuple[Part, int]]) -> None:
        """Marks taken elsewhere on this host (the GangServer's, from the channel's reply)."""
        self.marks.extend((Part(part), at) for part, at in marks)

    def parts_ms(self) -> list[tuple[Part, float]]:
        """Each part's milliseconds: its mark minus the previous one (the first: minus start).
        A part that recurs (a resent request) is summed into its first place."""
        out: dict[Part, float] = {}
        previous = self.start_ns
        for name, at in self.marks:
            out[name] = out.get(name, 0.0) + (at - previous) / 1e6
            previous = at
        return list(out.items())

    def total_ms(self) -> float:
        """From the start to the last mark."""
        return ((self.marks[-1][1] if self.marks else self.start_ns) - self.start_ns) / 1e6

    def server_timing(self) -> str:
        """The parts and their sum as a W3C Server-Timing header value (milliseconds)."""
        parts = [f"{part.value};dur={ms:.3f}" for part, ms in self.parts_ms()]
        return ", ".join([*parts, f"total;dur={self.total_ms():.3f}"])


def start(timeline: Timeline) -> contextvars.Token:
    """Make `timeline` the running task's current one (tasks it creates inherit it)."""
    return _current.set(timeline)


def reset(token: contextvars.Token) -> None:
    """Undo `start` (the task goes on without a timeline of its own)."""
    _current.reset(token)


def current() -> Timeline | None:
    """The running task's request timeline, if someone is timing it."""
    return _current.get()


def running_step(step: Timeline | None) -> contextvars.Token:
    """Set the timeline the step about to run (in this task) fills; reset with `end_step`."""
    return _current_step.set(step)


def end_step(token: contextvars.Token) -> None:
    _current_step.reset(token)


def current_step() -> Timeline | None:
    """The timeline of the step this task is running (None: nobody is timing it)."""
    return _current_step.get()


class BatchStep:
    """One batch step's part of its members' timelines (the requests it serves; a batcher runs
    the step in a task of its own): made when the step starts, it marks each member's `queue`
    and makes the step's own timeline the running task's (`running_step`), which the gang's
    step fills; `end()` (always) resets that, `hand_over()` (after a step that answered) gives
    each member the step's parts and `to_loop` (the sequencer thread -> the event loop)."""

    def __init__(self, members: list[Timeline]) -> None:
        self.members = members
        self.step = Timeline.starting_now() if members else None
        for t in members:
            t.mark(Part.QUEUE)  # the batcher: arrival -> its step starts
        self._token = running_step(self.step)

    def end(self) -> None:
        end_step(self._token)

    def hand_over(self) -> None:
        if self.step is None:
            return
        back = time.monotonic_ns()
        for t in self.members:
            t.extend(self.step.marks)
            t.mark(Part.TO_LOOP, back)


def wall_to_monotonic_ns(wall_ns: int) -> int:
    """A time.time_ns() stamp (rank 0's step clock) on the monotonic clock (to ~1 us).

    The clocks' offset is read between two monotonic reads, three times, and the tightest
    pair wins: a thread preempted between the reads (a busy machine) would otherwise shift
    the stamp by the preemption and turn a part negative."""
    best_gap, offset = None, 0
    for _ in range(3):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best_gap is None or after - before < best_gap:
            best_gap, offset = after - before, wall - (before + after) // 2
    return wall_ns - offset
