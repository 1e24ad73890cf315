"""Dynamic batching in front of the sequencer.

Concurrent requests with the same sequence length are concatenated along the batch dim
and run as ONE gang step (one broadcast, one all_reduce per layer), then split back:

    [b_1, s, E] ... [b_k, s, E]  --cat-->  [sum b_i, s, E]  --step-->  split at b_1, b_1+b_2, ...

Attention mixes positions only within a sequence, never across batch rows, so each
request's rows are exactly what it would get alone (up to float rounding of a larger
matmul). At most `max_in_flight` steps run at once (1 in front of the gang's sequencer);
requests that arrive while they run form the next batch, so under load batches grow by
themselves and an idle gang adds no wait (unless `wait_s` > 0 asks to linger for company):
a request that finds the batcher idle runs its step in its own task, at no cost over
calling the step directly.

The same class batches twice: in the GangServer (one gang step per batch) and in each
ingress replica (one handle call per batch, `max_in_flight=2` so one batch crosses the
hop while the gang computes the previous one), which amortises the per-call cost of the
hop over every request in the batch.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

StepFn = Callable[[np.ndarray], Awaitable[np.ndarray]]
# (rows, seconds, error or None) after each step: the metrics' hook (service.metrics).
StepObserver = Callable[[int, float, "BaseException | None"], None]


@dataclass
class _Pending:
    x: np.ndarray  # [batch, seq, E]
    future: asyncio.Future


class StepBatcher:
    """Coalesces concurrent `submit` calls into steps of at most `max_batch_size` rows."""

    def __init__(self, run_step: StepFn, *, max_batch_size: int, wait_s: float, max_in_flight: int = 1,
                 on_step: StepObserver | None = None) -> None:
        self._run_step = run_step
        self._on_step = on_step
        self._max_rows = max_batch_size
        self._wait_s = wait_s
        self._slots = asyncio.Semaphore(max_in_flight)
        self._running: set[asyncio.Task] = set()  # strong refs: the loop keeps only weak ones
        self._pending: list[_Pending] = []
        self._drainer: asyncio.Task | None = None
        self.steps = 0  # counters for /gang and the benchmark
        self.requests = 0
        self.inline_steps = 0  # steps run in the submitting task (the batcher was idle)
        self._step_ms: deque[float] = deque(maxlen=256)

    def stats(self) -> dict[str, float]:
        """Steps, requests served, and the median duration of the recent gang steps."""
        recent = list(self._step_ms)
        return {
            "steps": self.steps,
            "requests": self.requests,
            "inline_steps": self.inline_steps,
            "recent_step_ms_p50": round(statistics.median(recent), 3) if recent else 0.0,
        }

    async def submit(self, x: np.ndarray) -> np.ndarray:
        """x [batch, seq, E] -> this request's rows of the batched step's output."""
        loop = asyncio.get_running_loop()
        item = _Pending(x, loop.create_future())
        if not self._pending and self._wait_s <= 0 and not self._slots.locked():
            # Idle: nobody to batch with and a slot free. Run the step in the caller's own
            # task (no drainer or group task, no extra loop iterations); requests that
            # arrive meanwhile queue as usual and form the next batch.
            await self._slots.acquire()  # free, so this does not yield
            self.inline_steps += 1
            await self._run_group([item])
            return item.future.result()
        self._pending.append(item)
        if self._drainer is None or self._drainer.done():
            self._drainer = loop.create_task(self._drain())
        try:
            return await item.future
        except asyncio.CancelledError:
            if item in self._pending:  # not taken yet: it will never run
                self._pending.remove(item)
            raise

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            await self._slots.acquire()  # requests keep queueing while every slot is busy
            if self._wait_s > 0 and self._pending_rows() < self._max_rows:
                await asyncio.sleep(self._wait_s)
            group = self._take_group()
            if not group:
                self._slots.release()
                continue
            task = loop.create_task(self._run_group(group))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run_group(self, group: list[_Pending]) -> None:
        """One step for `group` (holding one slot); every member gets its rows or the error."""
        try:
            x = group[0].x if len(group) == 1 else np.concatenate([p.x for p in group])
            started = time.perf_counter()
            try:
                out = await self._run_step(x)  # [sum b_i, seq, E]
            except Exception as exc:
                if self._on_step:
                    self._on_step(x.shape[0], time.perf_counter() - started, exc)
                for p in group:
                    if not p.future.done():
                        p.future.set_exception(exc)
                return
            self._step_ms.append((time.perf_counter() - started) * 1000)
            if self._on_step:
                self._on_step(x.shape[0], self._step_ms[-1] / 1000, None)
            self.steps += 1
            self.requests += len(group)
            start = 0
            for p in group:
                rows = p.x.shape[0]
                if not p.future.done():
                    p.future.set_result(out[start : start + rows])
                start += rows
        finally:
            self._slots.release()

    def _pending_rows(self) -> int:
        return sum(p.x.shape[0] for p in self._pending)

    def _take_group(self) -> list[_Pending]:
        """FIFO: the oldest request plus later ones of the same seq len, up to max rows."""
        self._pending = [p for p in self._pending if not p.future.done()]
        if not self._pending:
            return []
        seq_len = self._pending[0].x.shape[1]
        group, rest, rows = [], [], 0
        for p in self._pending:
            fits = not group or rows + p.x.shape[0] <= self._max_rows
            if p.x.shape[1] == seq_len and fits:
                group.append(p)
                rows += p.x.shape[0]
            else:
                rest.append(p)
        self._pending = rest
        return group
