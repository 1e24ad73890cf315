"""When a step's phases happened, measured where the work runs (the host on CPU, the GPU on CUDA).

On CUDA, a time.time_ns() taken after launching a collective or a kernel says when it was
queued, not when it ran: a step's broadcast and forward would read about 0 ms and all its
GPU time would land in whatever synchronizes next. So on CUDA each mark records a CUDA
event; the marks become wall-clock ns (the form GET /gang's step-loop stats subtract) as
the host time of the first mark plus the GPU's elapsed time since it. That anchor is right
when the GPU is idle at the first mark, which holds for a rank at the start of a step (the
previous step's all_reduce completed on every rank before rank 0 sent this step's header).
"""
from __future__ import annotations

import time

import torch


class StepClock:
    """Marks of one step: `mark()` at each phase end, `stamps()` once the work is done."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._t0 = time.time_ns()
        self._host: list[int] = []
        self._events: list[torch.cuda.Event] = []
        if self._cuda:
            self._events.append(self._record())

    @staticmethod
    def _record() -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        """The work queued so far on this device is one phase more."""
        if self._cuda:
            self._events.append(self._record())
        else:
            self._host.append(time.time_ns())

    def ready(self) -> bool:
        """Whether `stamps()` can answer without waiting (always on CPU)."""
        return not self._cuda or self._events[-1].query()

    def stamps(self) -> list[int]:
        """Wall-clock ns of each mark, in order (on CUDA: waits for the last one)."""
        if not self._cuda:
            return list(self._host)
        first = self._events[0]
        self._events[-1].synchronize()
        return [self._t0 + int(first.elapsed_time(e) * 1e6) for e in self._events[1:]]
