"""Dynamic batching in front of the sequencer.

Concurrent requests are concatenated along the batch dim and run as ONE gang step (one
broadcast, one all_reduce per layer), then split back:

    [b_1, s_1, E] ... [b_k, s_k, E]  --pad to S = max s_i, cat-->  [sum b_i, S, E]
        + key mask [sum b_i, S] (True = token)  --step-->  rows b_1, b_1+b_2, ..., each cut to s_i

Attention mixes positions only within a sequence, never across batch rows, and a padded
key takes part in no softmax (the mask), so each request's rows are exactly what it would
get alone (up to float rounding of a larger matmul). Right-padding keeps causal requests
exact too: a real query i < s attends keys j <= i < s, all real. A step carries a mask
only when it needs one: equal lengths and no request mask = the unmasked fast path.

Requests with different `causal` flags never share a step. Padding costs compute, so the
waste is bounded: a group takes the oldest request (FIFO), then the queued ones closest to
its length first, while the step's padded share, `1 - sum(b_i s_i) / (sum(b_i) S)`, stays
at most `max_padding_fraction` (0: equal lengths only). `stats()` reports the tokens and
padded tokens of the steps (/gang) and the observer gets each step's padded share (/metrics).

At most `max_in_flight` steps run at once (1, in front of the gang's sequencer);
requests that arrive while they run form the next batch, so under load batches grow by
themselves. A request that finds the batcher idle never waits: it runs its step in its own
task at once, at no cost over calling the step directly, whatever `wait_s` says. `wait_s` > 0
lingers for company only for requests queued behind a running step (when its slot frees and
fewer than max_batch_size rows are queued; the linger ends early once they are): a lone
request on an idle gang has no company to wait for, while concurrent ones still gather.

Deadlines: each request may carry a `time.monotonic()` deadline. One that passes while
the request is still queued drops it (never computed) and fails it at that instant with
DeadlineExceededBeforeStep (504 `deadline_exceeded`); one that passes while its step runs
fails it at that instant too (the step's other rows are unaffected). A step is called
with the latest deadline of its requests (None if any has none), so the step function
can stop waiting for its result then. A queued request whose caller is cancelled (the
client disconnected, or the ingress gave up) is dropped as well. `on_drop(reason, n)`
hears of both ("deadline", "cancelled"), for /metrics; `stats()` counts them.

The queue, the deadlines, cancellation and the steps in flight are `BatchQueue`, the
batching core that the session appends' batcher (service.sessions.batcher) runs on too;
`StepBatcher` adds only how requests group (padding) and what a step does with them.

It is the one batcher on the request path, in the GangServer (one gang step per batch):
the ingress sends every request on its own, so this batcher sees the requests of every
ingress replica at once, and Serve counts each as an ongoing request of the gang (what its
autoscaler reads).
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, TypeVar

import numpy as np

from service.config.builder_args import BatchPolicy
from service.contract.errors import DeadlineExceeded, DeadlineExceededBeforeStep
from service.metrics import timeline

# (x [batch, seq, E] float32, key mask [batch, seq] bool or None, causal or None,
#  the latest monotonic deadline of the step's requests or None) -> output
StepFn = Callable[[np.ndarray, "np.ndarray | None", "bool | None", "float | None"], Awaitable[np.ndarray]]
# (reason: "deadline" | "cancelled", requests) when queued requests are dropped uncomputed
DropObserver = Callable[[str, int], None]
# (rows, seconds, error or None, padded share of the step's tokens) after each step: the
# metrics' hook (service.metrics.recorders).
StepObserver = Callable[[int, float, "BaseException | None", float], None]


@dataclass(eq=False)  # identity: `in` / remove() must never compare the arrays
class Queued:
    """One queued call as the batching core sees it (each batcher adds its own input)."""

    future: asyncio.Future
    deadline: float | None  # time.monotonic() instant; None: none
    timer: asyncio.TimerHandle | None = None
    expired_in_step: bool = False  # answered at its deadline after its group was taken


Q = TypeVar("Q", bound=Queued)


@dataclass(frozen=True)
class DeadlineWords:
    """What a caller is told when its deadline passes: queued (never computed), taken but
    not yet started (never computed), or while its step runs."""

    queued: str
    before_step: str
    running: str


class BatchQueue(Generic[Q]):
    """The batching core under both batchers (this module's StepBatcher, and the session
    appends' service.sessions.batcher): the queue, one deadline mechanism, cancellation
    and the steps in flight. What forms a group (`take`) and what a step does with it
    (`run`: it answers every member's future) are the batcher's.

    Deadlines: a timer per queued call answers it at its deadline (queued: dropped and
    never computed; taken: DeadlineExceeded now, its step's other members unaffected).
    A caller that goes away while queued is dropped. At most `max_in_flight` steps run at
    once; calls that arrive meanwhile form the next group. Before taking a group, the queue
    lingers `linger(queued)` seconds for company (0: none), re-asked at every arrival: it
    ends once `linger` says 0 or the first answer's time is up. With `inline_when_idle`, a
    call that finds the queue idle runs its step in its own task at once (no linger: it is
    for calls queued behind a running step), at no cost over calling it."""

    def __init__(self, take: Callable[[list[Q]], list[Q]], run: Callable[[list[Q], "float | None"], Awaitable[None]],
                 words: DeadlineWords, *, max_in_flight: int = 1,
                 linger: Callable[[list[Q]], float] = lambda queued: 0.0, inline_when_idle: bool = False,
                 on_drop: DropObserver | None = None) -> None:
        self._take, self._run, self._words = take, run, words
        self._linger = linger  # seconds to wait for company, given what is queued
        self._arrived = asyncio.Event()  # set by every submit that queues: the linger asks again
        self._inline = inline_when_idle
        self._on_drop = on_drop
        self._slots = asyncio.Semaphore(max_in_flight)
        self._running: set[asyncio.Task] = set()  # strong refs: the loop keeps only weak ones
        self.pending: list[Q] = []
        self._drainer: asyncio.Task | None = None
        self.inline_steps = 0  # steps run in the submitting task (the queue was idle)
        self.expired_queued = 0  # dropped uncomputed: deadline passed while queued
        self.expired_running = 0  # deadline passed while their step ran
        self.cancelled_queued = 0  # dropped uncomputed: the caller went away

    @property
    def idle(self) -> bool:
        """Nothing queued and no step running (a drain waits for this)."""
        return not self.pending and not self._running and not self._slots.locked()

    async def submit(self, item: Q) -> object:
        """Queue `item` and wait for its answer (what `run` set on its future)."""
        loop = asyncio.get_running_loop()
        if item.deadline is not None and item.deadline <= time.monotonic():
            self.dropped("deadline", 1)
            raise DeadlineExceededBeforeStep(self._words.queued)
        if self._inline and not self.pending and not self._slots.locked():
            # Idle: nobody to batch with and a slot free. Run the step in the caller's own
            # task at once (no drainer or group task, no extra loop iterations, and no linger:
            # lingering would only delay a lone request); calls that arrive meanwhile queue
            # as usual and form the next group, lingering for company as `linger` says.
            await self._slots.acquire()  # free, so this does not yield
            self.inline_steps += 1
            await self._run_group([item])
            return item.future.result()
        self.pending.append(item)
        self._arrived.set()
        if item.deadline is not None:
            item.timer = loop.call_at(_loop_time(loop, item.deadline), self._expire, item)
        if self._drainer is None or self._drainer.done():
            self._drainer = loop.create_task(self._drain())
        try:
            return await item.future
        except asyncio.CancelledError:
            if item in self.pending:  # not taken yet: it will never run
                self.pending.remove(item)
                self.dropped("cancelled", 1)
            raise
        finally:
            if item.timer is not None:
                item.timer.cancel()

    def dropped(self, reason: str, n: int) -> None:
        """`n` calls dropped uncomputed (`reason`: "deadline" or "cancelled")."""
        if reason == "deadline":
            self.expired_queued += n
        else:
            self.cancelled_queued += n
        if self._on_drop is not None:
            self._on_drop(reason, n)

    def _expire(self, item: Q) -> None:
        """`item`'s deadline: answer it now, and drop it if it has not been taken yet."""
        if item.future.done():
            return
        if item in self.pending:
            self.pending.remove(item)
            self.dropped("deadline", 1)
            item.future.set_exception(DeadlineExceededBeforeStep(self._words.queued))
        else:
            self.expired_running += 1
            item.expired_in_step = True
            item.future.set_exception(DeadlineExceeded(self._words.running))

    def _drop_late(self, items: list[Q]) -> list[Q]:
        """Answer the members of `items` whose deadline has passed (never computed) and
        remove them from it; returns the rest."""
        now = time.monotonic()
        late = [q for q in items if q.deadline is not None and q.deadline <= now]
        if late:
            for q in late:
                items.remove(q)
                if not q.future.done():
                    q.future.set_exception(DeadlineExceededBeforeStep(self._words.before_step))
            self.dropped("deadline", len(late))
        return items

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self.pending:
            await self._slots.acquire()  # calls keep queueing while every slot is busy
            await self._linger_for_company(loop)
            self.pending = [q for q in self.pending if not q.future.done()]
            self._drop_late(self.pending)  # before `take`: a late call takes no room in the group
            group = self._take(self.pending) if self.pending else []
            taken = {id(q) for q in group}
            self.pending = [q for q in self.pending if id(q) not in taken]
            if not group:
                self._slots.release()
                continue
            task = loop.create_task(self._run_group(group))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _linger_for_company(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait while `linger(queued)` asks for company, at most its first answer's seconds."""
        wait = self._linger(self.pending)
        if wait <= 0:
            return
        until = loop.time() + wait
        while (left := until - loop.time()) > 0 and self._linger(self.pending) > 0:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    async def _run_group(self, group: list[Q]) -> None:
        """One step for `group` (holding one slot); late members are answered uncomputed."""
        try:
            group = self._drop_late(group)  # expired between being taken and now: never computed
            if not group:
                return
            deadlines = [q.deadline for q in group]
            await self._run(group, None if None in deadlines else max(d for d in deadlines if d is not None))
        finally:
            self._slots.release()


@dataclass(eq=False, kw_only=True)
class _Pending(Queued):
    x: np.ndarray  # [batch, seq, E]
    mask: np.ndarray | None  # [batch, seq] bool, True = token; None = all tokens
    causal: bool | None  # None: the served model's default
    # The request's timeline (service.metrics.timeline), taken in the submitting task: its
    # step may run in another task, which gets the step's timeline through `running_step`.
    request_timeline: timeline.Timeline | None = field(default_factory=timeline.current)

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])

    @property
    def seq(self) -> int:
        return int(self.x.shape[1])


class StepBatcher:
    """Coalesces concurrent `submit` calls into steps, as `policy` says (on a BatchQueue)."""

    def __init__(self, run_step: StepFn, policy: BatchPolicy, *, on_step: StepObserver | None = None,
                 on_drop: DropObserver | None = None) -> None:
        self._run_step = run_step
        self._on_step = on_step
        self._max_rows = policy.max_batch_size
        self._max_padding = policy.max_padding_fraction
        self._queue: BatchQueue[_Pending] = BatchQueue(
            self._take_group, self._step, _REQUEST_DEADLINE, max_in_flight=policy.max_in_flight,
            linger=lambda queued: policy.wait_s if sum(p.rows for p in queued) < self._max_rows else 0.0,
            inline_when_idle=True, on_drop=on_drop)
        self.steps = 0  # counters for /gang and the benchmark
        self.requests = 0
        self.tokens = 0  # batch rows x seq of every step, padding included
        self.padded_tokens = 0  # of which padding added to batch mixed lengths
        self.mixed_steps = 0  # steps that padded requests of different lengths
        self._step_ms: deque[float] = deque(maxlen=256)
        self._padded_share: deque[float] = deque(maxlen=256)

    def stats(self) -> dict[str, float]:
        """Steps, requests served, and the median duration of the recent gang steps."""
        recent = list(self._step_ms)
        shares = list(self._padded_share)
        return {
            "steps": self.steps,
            "requests": self.requests,
            "inline_steps": self._queue.inline_steps,
            "recent_step_ms_p50": round(statistics.median(recent), 3) if recent else 0.0,
            "mixed_length_steps": self.mixed_steps,
            "tokens": self.tokens,
            "padded_tokens": self.padded_tokens,
            "padded_token_share": round(self.padded_tokens / self.tokens, 4) if self.tokens else 0.0,
            "recent_padded_token_share_mean": round(statistics.fmean(shares), 4) if shares else 0.0,
            "max_padding_fraction": self._max_padding,
            "expired_queued": self._queue.expired_queued,
            "expired_running": self._queue.expired_running,
            "cancelled_queued": self._queue.cancelled_queued,
        }

    @property
    def idle(self) -> bool:
        """Nothing queued and no step running (a drain waits for this)."""
        return self._queue.idle

    async def submit(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                     deadline: float | None = None) -> np.ndarray:
        """x [batch, seq, E] (+ key mask [batch, seq] bool, causal) -> this request's output
        [batch, seq, E] from the batched step; DeadlineExceeded at `deadline` (monotonic)."""
        item = _Pending(asyncio.get_running_loop().create_future(), deadline, x=x, mask=mask, causal=causal)
        out = await self._queue.submit(item)
        assert isinstance(out, np.ndarray)
        return out

    async def _step(self, group: list[_Pending], deadline: float | None) -> None:
        """One gang step for `group`; every member gets its rows or the error."""
        x, mask, padded = pad_group([(p.x, p.mask) for p in group])
        rows, seq = int(x.shape[0]), int(x.shape[1])
        share = padded / (rows * seq) if rows * seq else 0.0
        started = time.perf_counter()
        batch = timeline.BatchStep([p.request_timeline for p in group if p.request_timeline is not None])
        try:
            out = await self._run_step(x, mask, group[0].causal, deadline)  # [sum b_i, S, E]
        except Exception as exc:
            if isinstance(exc, DeadlineExceededBeforeStep):  # the step function dropped it uncomputed (the sequencer)
                self._queue.expired_running -= sum(1 for p in group if p.expired_in_step)
                self._queue.dropped("deadline", len(group))
            if self._on_step:
                self._on_step(rows, time.perf_counter() - started, exc, share)
            for p in group:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        finally:
            batch.end()
        batch.hand_over()
        self._step_ms.append((time.perf_counter() - started) * 1000)
        if self._on_step:
            self._on_step(rows, self._step_ms[-1] / 1000, None, share)
        self.steps += 1
        self.requests += len(group)
        self.tokens += rows * seq
        self.padded_tokens += padded
        self._padded_share.append(share)
        if padded:
            self.mixed_steps += 1
        start = 0
        for p in group:
            if not p.future.done():
                mine = out[start : start + p.rows]
                # Cut back to the request's own length (a copy: the reply must not pin
                # the whole step's output, and encoders want C order).
                p.future.set_result(mine if p.seq == seq else np.ascontiguousarray(mine[:, : p.seq]))
            start += p.rows

    def _take_group(self, pending: list[_Pending]) -> list[_Pending]:
        """The oldest request, plus queued ones of the same `causal`, closest in length first,
        while rows <= max_batch_size and the padded share <= max_padding_fraction."""
        first = pending[0]
        group, rows, seq_max, real = [first], first.rows, first.seq, first.rows * first.seq
        candidates = sorted(
            (p for p in pending[1:] if p.causal == first.causal),
            key=lambda p: abs(p.seq - first.seq),  # stable: FIFO among equal distances
        )
        for p in candidates:
            if rows + p.rows > self._max_rows:
                continue
            new_max = max(seq_max, p.seq)
            new_rows, new_real = rows + p.rows, real + p.rows * p.seq
            if 1.0 - new_real / (new_rows * new_max) > self._max_padding + 1e-12:
                continue
            group.append(p)
            rows, seq_max, real = new_rows, new_max, new_real
        return group


_REQUEST_DEADLINE = DeadlineWords(
    queued="the request's deadline passed while it was queued for the gang; it was not computed",
    before_step="the request's deadline passed before its gang step started; it was not computed",
    running="the request's deadline passed before the gang's answer to it was ready")


def pad_group(items: list[tuple[np.ndarray, np.ndarray | None]]) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Requests (x_i [b_i, s_i, E], mask_i [b_i, s_i] bool or None) as one step's input:
    (x [sum b_i, S, E] float32, key mask [sum b_i, S] bool or None, padded tokens added).

    S = max s_i; each request's rows are right-padded with zeros and their padding masked
    out. The mask is None (the unmasked fast path) when every s_i == S and no request
    carries a mask; a request's own mask is kept as it is.
    """
    seq = max(int(x.shape[1]) for x, _ in items)
    if all(mask is None and x.shape[1] == seq for x, mask in items):
        x = items[0][0] if len(items) == 1 else np.concatenate([x for x, _ in items])
        return x, None, 0
    if len(items) == 1:  # one request with its own mask: nothing to pad
        return items[0][0], items[0][1], 0
    rows = sum(int(x.shape[0]) for x, _ in items)
    width = int(items[0][0].shape[2])
    out = np.zeros((rows, seq, width), dtype=np.float32)  # [sum b_i, S, E]
    mask = np.zeros((rows, seq), dtype=bool)  # [sum b_i, S], True = token
    start, padded = 0, 0
    for x, own in items:
        b, s = int(x.shape[0]), int(x.shape[1])
        out[start : start + b, :s] = x
        mask[start : start + b, :s] = True if own is None else own
        padded += b * (seq - s)
        start += b
    return out, mask, padded


def _loop_time(loop: asyncio.AbstractEventLoop, deadline: float) -> float:
    """A time.monotonic() instant on `loop`'s clock (the same clock by default; uvloop's may differ)."""
    return loop.time() + (deadline - time.monotonic())
