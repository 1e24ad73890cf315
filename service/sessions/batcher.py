"""Continuous batching of session appends: many sessions' new rows share one gang step.

Appends queue here; one step runs at a time (the gang's sequencer runs one anyway), and the
appends that arrive while it runs form the next one. A step takes the oldest queued
append, then the next queued appends of *other* sessions (a session's appends are ordered:
its second append attends over its first, so at most one per session per step), while

    sessions <= max_sessions_per_step, new rows <= max_rows_per_step, and
    sum over its sessions of blocks(length + n) <= num_blocks

(the last bound: the step's sessions must fit the pool together even if every one of them
is recomputed, so its placement can always succeed by evicting sessions outside it). Each
session keeps its own context length: the step's plan carries every one
(service.parallel.kv_cache), no padding to a common length.

Deadlines: an append whose deadline passes while queued is dropped (never computed:
504 `deadline_exceeded`, nothing appended). One whose deadline passes while its step runs
answers 504 at once, and the append still completes (GET /sessions/{id} shows the length;
a retry with the same idempotency key gets its answer, service.sessions.registry).

Idempotency keys: a keyed append's claim (service.sessions.registry.Claim) rides with it
into its step (StepItem.claim), where the registry settles it; its caller withdraws it once
done (service.sessions.service), so one never planned is never appended.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import numpy as np

from service.gang.batching import BatchQueue, DeadlineWords, Queued
from service.sessions.registry import Claim, Session, StepItem

# (items of one step, latest deadline or None) -> [(rows or None, info or error)] in item order
RunStep = Callable[[list[StepItem], "float | None"], Awaitable[list[tuple[Any, Any]]]]

_APPEND_DEADLINE = DeadlineWords(
    queued="the append's deadline passed while it was queued; nothing was appended",
    before_step="the append's deadline passed before its step started; nothing was appended",
    running="the append's deadline passed while its step ran; the append itself completes "
            "(GET /sessions/{id} shows the length)")


@dataclass(eq=False, kw_only=True)
class _Queued(Queued):
    session: Session
    x: np.ndarray  # [n, E] float32
    expect_length: int | None = None
    claim: Claim | None = None


class AppendBatcher:
    """Groups queued appends of distinct sessions into steps (see the module docstring),
    on the batching core (service.gang.batching.BatchQueue: the queue, deadlines, cancellation)."""

    def __init__(self, run_step: RunStep, *, max_sessions_per_step: int, max_rows_per_step: int,
                 num_blocks: int, blocks_for: Callable[[int], int], wait_s: float = 0.0) -> None:
        self._run_step = run_step
        self._max_sessions = max_sessions_per_step
        self._max_rows = max_rows_per_step
        self._num_blocks = num_blocks
        self._blocks_for = blocks_for
        # linger wait_s for company while fewer sessions than a full step wait
        self._queue: BatchQueue[_Queued] = BatchQueue(
            self._take_group, self._step, _APPEND_DEADLINE, wait_s=wait_s,
            company=lambda queued: len({q.session.id for q in queued}) < self._max_sessions)
        self.steps = 0
        self.appends = 0
        self.max_step_sessions = 0

    def stats(self) -> dict[str, float]:
        return {"steps": self.steps, "appends": self.appends, "max_sessions_in_a_step": self.max_step_sessions,
                "queued": len(self._queue.pending), "expired_queued": self._queue.expired_queued,
                "appends_per_step": round(self.appends / self.steps, 3) if self.steps else 0.0}

    @property
    def idle(self) -> bool:
        return self._queue.idle

    async def submit(self, session: Session, x: np.ndarray, deadline: float | None,
                     expect_length: int | None = None, claim: Claim | None = None) -> tuple[np.ndarray, dict]:
        """x [n, E] float32 appended to `session` -> (its output rows [n, E], the session's info);
        `claim`: its idempotency key's, settled by the registry when its step plans or ends."""
        item = _Queued(asyncio.get_running_loop().create_future(), deadline, session=session, x=x,
                       expect_length=expect_length, claim=claim)
        session.busy += 1
        try:
            answer = await self._queue.submit(item)
        finally:
            session.busy -= 1
        assert isinstance(answer, tuple)
        return answer

    async def _step(self, group: list[_Queued], deadline: float | None) -> None:
        """One append step for `group`; every member gets its rows and info, or its error."""
        try:
            results = await self._run_step([StepItem(q.session, q.x, q.expect_length, claim=q.claim)
                                             for q in group], deadline)
        except BaseException as exc:  # noqa: BLE001 - every member gets the step's error
            for q in group:
                if not q.future.done():
                    q.future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self.steps += 1
        self.appends += len(group)
        self.max_step_sessions = max(self.max_step_sessions, len(group))
        for q, (rows, info) in zip(group, results):
            if q.future.done():
                continue
            if isinstance(info, BaseException):
                q.future.set_exception(info)
            else:
                q.future.set_result((rows, info))

    def _take_group(self, pending: list[_Queued]) -> list[_Queued]:
        group: list[_Queued] = []
        seen: set[str] = set()
        rows = blocks = 0
        for q in pending:
            if q.session.id in seen:
                continue
            seen.add(q.session.id)  # a session's later appends wait behind its first queued one
            n = int(q.x.shape[0])
            # rows it brings: n, or its whole length again if it will be recomputed
            mine = n if q.session.cached == q.session.length else q.session.length + n
            need = self._blocks_for(q.session.length + n)
            if group and (len(group) >= self._max_sessions or rows + mine > self._max_rows
                          or blocks + need > self._num_blocks):
                continue
            group.append(q)
            rows += mine
            blocks += need
        return group
