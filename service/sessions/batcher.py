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

Chunked prefill (issue 52, as vLLM's): an append whose work (its rows, and the session's kept
rows when they must be recomputed) is longer than a chunk runs as several queue items, one chunk
each: at most `chunk_rows` rows, fewer in a step shared with other appends, sized so that the step
takes at most `chunk_step_ratio` times their step alone (service.sessions.chunk_budget, from the
steps' measured durations); after each chunk's step the append is queued again, at
the back, so the appends of other sessions queued meanwhile share the next step with its next
chunk, instead of waiting for the whole prefill. Its answer (every own row's output) comes with
its last chunk, whose commit alone applies it (service.sessions.registry.Chunking); the
session's other appends wait until then (a session's appends stay in order). A caller that gives
up between chunks abandons it: nothing is appended.

A chunk waits for the sessions it just stepped with: the next chunk is queued the moment its
step ends, while the appends answered by that step are still on their way back to their
clients, and their next appends arrive a round trip later. Taken at once, the chunk would
run a step alone and those appends would wait behind it and then share the next step with
another chunk: two chunks' time per append. So a queue that holds a chunk but not yet
every session whose append the last step answered lingers for them, at most `chunk_linger_s`
(ending as soon as they are all queued): each decoding session's append then meets one
chunk per step. Only a chunk after an append's first waits: one-row appends with no prefill in
progress are batched as `wait_s` says. Measured (bench/NOTES.md): 8 decoding sessions beside a
4,096-row prefill in 256-row chunks, no batch wait, a 50 ms bound: their appends' p99
1,115-1,209 -> 778-814 ms, p50 764-860 -> 540-556 ms, the prefill about 25 % slower.

Idempotency keys: a keyed append's claim (service.sessions.registry.Claim) rides with it
into its step (StepItem.claim), where the registry settles it; its caller withdraws it once
done (service.sessions.service), so one never planned is never appended.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

from service.contract.gang_status import SessionBatchingStats
from service.gang.batching import BatchQueue, DeadlineWords, Queued
from service.metrics import timeline
from service.sessions.chunk_budget import ChunkBudget
from service.sessions.registry import Chunking, Claim, Session, StepItem

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
    chunking: Chunking | None = None
    # The append's timeline (service.metrics.timeline), taken in the submitting task: the step
    # runs in the queue's task, which hands it the step's marks (each chunk's, summed by name).
    request_timeline: timeline.Timeline | None = field(default_factory=timeline.current)


class AppendBatcher:
    """Groups queued appends of distinct sessions into steps (see the module docstring),
    on the batching core (service.gang.batching.BatchQueue: the queue, deadlines, cancellation)."""

    def __init__(self, run_step: RunStep, *, max_sessions_per_step: int, max_rows_per_step: int,
                 num_blocks: int, blocks_for: Callable[[int], int], wait_s: float = 0.0, chunk_rows: int = 0,
                 chunk_linger_s: float = 0.0, chunk_step_ratio: float = 0.0,
                 abandon: Callable[[Session, Chunking, Claim | None], None] | None = None) -> None:
        """`wait_s`: linger for company while fewer than a full step's sessions are queued;
        `chunk_rows`: chunked prefill's rows per step, at most (0: none); `chunk_linger_s`: the
        longest a chunk waits for the sessions of the step before (module docstring; 0: never);
        `chunk_step_ratio`: a step that carries a chunk and other appends should take at most this
        many times a step of one-row appends alone: its chunk's rows shrink to fit
        (service.sessions.chunk_budget; 0: every chunk `chunk_rows`); `abandon`: the registry's,
        told when a chunked append's caller gives up after a chunk was computed."""
        self._run_step = run_step
        self._chunk = chunk_rows
        self._budget = ChunkBudget(chunk_rows, chunk_step_ratio, min_rows=max(1, chunk_rows // 16)) \
            if chunk_rows > 0 else None
        self._wait_s = wait_s
        self._chunk_linger_s = chunk_linger_s
        self._answered: set[str] = set()  # sessions whose append the last step answered
        self._abandon = abandon
        self._chunked: dict[str, Chunking] = {}  # session id -> its append in progress between chunks
        self._max_sessions = max_sessions_per_step
        self._max_rows = max_rows_per_step
        self._num_blocks = num_blocks
        self._blocks_for = blocks_for
        self._queue: BatchQueue[_Queued] = BatchQueue(self._take_group, self._step, _APPEND_DEADLINE,
                                                      linger=self._linger)
        self.steps = 0
        self.appends = 0
        self.max_step_sessions = 0
        self.chunk_steps = 0  # chunks computed before an append's last (its step answered nothing yet)

    def _linger(self, queued: list[_Queued]) -> float:
        """Seconds to wait for company before the next step (BatchQueue asks again at every arrival)."""
        sessions = {q.session.id for q in queued}
        if len(sessions) >= self._max_sessions:
            return 0.0
        if self._chunk_linger_s > 0 and self._answered - sessions and any(self._between_chunks(q) for q in queued):
            return max(self._chunk_linger_s, self._wait_s)
        return self._wait_s

    def _between_chunks(self, q: _Queued) -> bool:
        """Whether `q` is the next chunk of an append whose earlier chunks were computed."""
        return q.chunking is not None and self._chunked.get(q.session.id) is q.chunking

    def stats(self) -> SessionBatchingStats:
        return SessionBatchingStats(
            steps=self.steps, appends=self.appends, max_sessions_in_a_step=self.max_step_sessions,
            prefill_chunks=self.chunk_steps, queued=len(self._queue.pending), expired_queued=self._queue.expired_queued,
            appends_per_step=round(self.appends / self.steps, 3) if self.steps else 0.0)

    @property
    def idle(self) -> bool:
        return self._queue.idle

    async def submit(self, session: Session, x: np.ndarray, deadline: float | None,
                     expect_length: int | None = None, claim: Claim | None = None) -> tuple[np.ndarray, dict]:
        """x [n, E] float32 appended to `session` -> (its output rows [n, E], the session's info);
        `claim`: its idempotency key's, settled by the registry when its step plans or ends.
        A long append runs chunk by chunk (module docstring): each chunk is one queue item."""
        chunking = Chunking(self._chunk) if self._chunk > 0 else None
        session.busy += 1
        try:
            while True:
                item = _Queued(asyncio.get_running_loop().create_future(), deadline, session=session, x=x,
                               expect_length=expect_length, claim=claim, chunking=chunking)
                answer = await self._queue.submit(item)
                if isinstance(answer, tuple):
                    return answer
                assert isinstance(answer, Chunking)  # a chunk before the last: queue the next one
                self._chunked[session.id] = answer
                self.chunk_steps += 1
        except BaseException:
            if chunking is not None and (chunking.done or chunking.in_step) and self._abandon is not None:
                self._abandon(session, chunking, claim)
            raise
        finally:
            if chunking is not None and self._chunked.get(session.id) is chunking:
                del self._chunked[session.id]
            session.busy -= 1

    async def _step(self, group: list[_Queued], deadline: float | None) -> None:
        """One append step for `group`; every member gets its rows and info, or its error.
        Each member's timeline gets the step's parts (queue, handoff, broadcast, compute,
        all_reduce, to_numpy: service.gang.runner), as a stateless request's does."""
        # queue: arrival (or the previous chunk's end) -> this step starts
        batch = timeline.BatchStep([q.request_timeline for q in group if q.request_timeline is not None])
        items = [StepItem(q.session, q.x, q.expect_length, claim=q.claim, chunking=q.chunking) for q in group]
        started = time.monotonic()
        try:
            results = await self._run_step(items, deadline)
        except BaseException as exc:  # noqa: BLE001 - every member gets the step's error
            for q in group:
                if not q.future.done():
                    q.future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        finally:
            batch.end()
        batch.hand_over()
        if self._budget is not None:  # the step as its appends waited for it; items' rows as planned
            self._budget.observe(sum(i.rows for i in items if i.rows > 1), sum(1 for i in items if i.rows == 1),
                                 time.monotonic() - started)
        self.steps += 1
        self.appends += sum(1 for _, info in results if not isinstance(info, Chunking))
        self._answered = {q.session.id for q, (_, info) in zip(group, results)
                          if not isinstance(info, (Chunking, BaseException))}
        self.max_step_sessions = max(self.max_step_sessions, len(group))
        for q, (rows, info) in zip(group, results):
            if q.future.done():
                continue
            if isinstance(info, Chunking):  # its next chunk is queued by its submit
                q.future.set_result(info)
            elif isinstance(info, BaseException):
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
            active = self._chunked.get(q.session.id)
            if active is not None and q.chunking is not active:
                continue  # the session's chunked append goes on first; its own item is further back
            seen.add(q.session.id)  # a session's later appends wait behind its first queued one
            n = int(q.x.shape[0])
            # rows it brings: n, or its whole length again if it will be recomputed; a chunk at most
            mine = n if q.session.cached == q.session.length else q.session.length + n
            if q.chunking is not None:  # counted at the most a chunk computes (`_size_chunks` may shrink it)
                mine = min(self._chunk, max(1, mine - q.chunking.done))
            need = self._blocks_for(q.session.length + n)
            if group and (len(group) >= self._max_sessions or rows + mine > self._max_rows
                          or blocks + need > self._num_blocks):
                continue
            group.append(q)
            rows += mine
            blocks += need
        self._size_chunks(group)
        return group

    def _size_chunks(self, group: list[_Queued]) -> None:
        """This step's rows for each long append in `group`: the chunk budget's, shared with the
        group's other appends or alone (service.sessions.chunk_budget); a chunk only shrinks from
        the `chunk_rows` the group was counted at."""
        if self._budget is None:
            return
        # the step's one-row appends (a one-row append whose session is recomputed brings more rows)
        decoders = sum(1 for q in group if q.x.shape[0] == 1 and q.session.cached == q.session.length)
        chunk = self._budget.rows(others=decoders)
        for q in group:
            if q.chunking is not None:
                q.chunking.chunk = chunk
