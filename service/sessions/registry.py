"""The session registry: every session's state, owned by rank 0's process alone.

State per session: its id, its kept inputs (every row it was given, float32, host memory:
what makes eviction and the loss of a rank recoverable), its length, and its place in the
ranks' KV pools (a block table, see service.parallel.kv_cache) together with what that
cached K/V is valid for: the gang's `generation` (a rebuild bumps it and every pool is
new, i.e. empty) and the weights version it was computed with.

Invariant: a session's cached K/V is used only if it covers its whole length and was
computed by this generation of the gang with the weights version of the step; otherwise
the step recomputes it from the kept inputs (the session's rows go into the step with
cached length 0), which is counted (`recomputed_tokens`). So no answer mixes weights
versions, and a rebuilt rank is repaired by the next append.

Blocks: a free list over the pool's `num_blocks`. A step takes the blocks its sessions
need; when too few are free, sessions outside the step are evicted, least recently used
first (idle ones, i.e. with no append queued, before queued ones): their blocks return to
the free list and they keep their inputs (recomputed on their next append).

Exactly once (issue 52): every append the ingress sends carries an idempotency key
(service.sessions.keys). A session remembers the answers of its last `answers_kept` keyed
appends (tunables.gang.session_answers_kept): the key, a digest of the rows (their dtype,
shape and bytes), the output rows and the session's state after the append, stored in the
same critical section as the append itself (`_commit`), so no reader ever sees the rows
appended without the key remembered, or the reverse. `admit` is each keyed append's first
step: a remembered key with the same digest is a retry (the first answer, `KeptAnswer`,
nothing appended), with another digest 409 `idempotency_key_reused`; a key whose first
append is still in flight is that append's `Claim`, which a retry waits on (`settled`,
bounded by the retry's deadline), then looks again. A claim is settled exactly when it is
certain whether its rows were appended: committed (its answer kept), or not (refused at
plan time, the step aborted, or `withdraw`n by its caller before any step planned it:
planning skips a withdrawn claim, so an append whose caller went away early is never
appended behind a retry's back). What the kept answers cost: at most the session's own
rows again (each answer's outputs are rows of the session), plus ~2 KiB each (the key, the
digest and the state).

Threads: the event loop (open, lookups, close, expiry) and the gang's sequencer (plan and
commit of a step) both use the registry; one lock guards it (claims' states too). Blocks are only *taken* on
the sequencer, between steps, so blocks freed while a step runs are reused at the earliest
by the next step, after that one finished with them.
"""
from __future__ import annotations

import asyncio
import enum
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.contract.errors import (Conflict, DeadlineExceededBeforeStep, ErrorCode, InvalidInput, NotFound,
                                     SessionCacheFull, SessionGone, TooManySessions)
from service.parallel.kv_cache import AppendPlan
from service.sessions.ids import OIP_PREFIX, SessionIds

ENDED_KEPT = 100_000  # ended ids remembered (expired vs never known)


@dataclass(frozen=True)
class Limits:
    """The registry's bounds (service.config.builder_args.SessionConfig, and the pool's shape)."""

    num_blocks: int
    block_size: int
    max_sessions: int
    max_session_tokens: int
    idle_timeout_s: float
    bytes_per_token: int  # per rank: 2 * (E / world_size) * dtype bytes
    answers_kept: int = 16  # keyed answers each session remembers (tunables.gang.session_answers_kept)

    def __post_init__(self) -> None:
        if self.answers_kept < 1:
            raise ValueError(f"a session must remember at least its last append's key "
                             f"(tunables.gang.session_answers_kept >= 1); got {self.answers_kept}")

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass(frozen=True)
class KeptAnswer:
    """What a session remembers of one keyed append: the digest of its rows
    (service.sessions.keys.rows_digest), its output rows [n, E] float32 (a private, read-only
    copy) and the session's state right after it."""

    digest: bytes
    rows: np.ndarray
    info: dict[str, Any]

    def replay(self) -> tuple[np.ndarray, dict[str, Any]]:
        """The answer again, for a retry: a copy of the rows, the state marked `replayed`."""
        return self.rows.copy(), {**self.info, "replayed": True}


class ClaimState(enum.Enum):
    WAITING = "waiting"  # admitted, not planned into a step yet
    PLANNED = "planned"  # in a step: its commit or abort settles it
    SETTLED = "settled"  # certain: appended (its answer kept) or not


class Claim:
    """A keyed append in flight on one session (see the module docstring). Its state changes
    only under the registry's lock; `settled` wakes whoever waits on it, on their own loop."""

    def __init__(self, session: "Session", key: str, digest: bytes) -> None:
        self.session, self.key, self.digest = session, key, digest
        self.state = ClaimState.WAITING
        self.appended = False  # once SETTLED: whether the rows went in (the answer is kept)
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []


@dataclass(frozen=True)
class Admission:
    """`SessionRegistry.admit`'s verdict on a keyed append: a remembered answer to replay
    (`kept`), or a claim, which is this append's own (`first`: it runs) or an earlier try's
    still in flight (wait for it to settle, then ask again)."""

    kept: KeptAnswer | None = None
    claim: Claim | None = None
    first: bool = False


@dataclass(eq=False)
class Session:
    id: str
    created_at: float  # wall clock
    last_used: float  # time.monotonic()
    last_used_at: float  # wall clock
    inputs: list[np.ndarray] = field(default_factory=list)  # kept rows, each [n, E] float32
    length: int = 0
    blocks: list[int] = field(default_factory=list)  # its block table in the ranks' pools
    cached: int = 0  # positions whose K/V in the pools are valid (for `generation`, `version`)
    generation: int = -1
    version: int = 0  # weights version of the cached K/V and of the last answer
    busy: int = 0  # appends queued or running
    answers: OrderedDict[str, KeptAnswer] = field(default_factory=OrderedDict)  # key -> answer, oldest first
    claims: dict[str, Claim] = field(default_factory=dict)  # key -> its keyed append in flight
    appends: int = 0
    recomputed_tokens: int = 0
    evictions: int = 0

    def kept(self) -> np.ndarray:
        """All kept rows [length, E] (one array: joined once on a recompute)."""
        if len(self.inputs) > 1:
            self.inputs = [np.concatenate(self.inputs)]
        return self.inputs[0]


@dataclass(eq=False)
class Chunking:
    """One append's progress through chunked prefill (service.sessions.batcher): its *work* is
    the session's kept rows when their K/V must be recomputed, then its own n rows; each step
    computes the next `chunk` rows of it at positions base + done .. (base: 0 when recomputing,
    else the session's length). Only the last chunk's commit applies the append; the others
    record progress here. A rebuild, a weights swap or an eviction of the session between two
    chunks starts the work again (its K/V would no longer be valid)."""

    chunk: int  # rows per step (> 0)
    done: int = 0  # rows of the work computed so far
    recompute: bool = False
    base: int = 0
    generation: int = -1  # what the chunks so far were computed under
    version: int = -1
    evictions: int = -1
    outputs: list[np.ndarray] = field(default_factory=list)  # the append's own rows' outputs so far
    steps: int = 0  # chunk steps committed
    in_step: bool = False  # a chunk of it is planned and its step not yet committed or aborted
    abandoned: bool = False  # its caller gave up (service.sessions.batcher): settle, plan no more


@dataclass
class StepItem:
    """One session's part of a step: its new rows, and what the step made of it."""

    session: Session
    x: np.ndarray  # [n, E] float32
    expect_length: int | None = None  # the append's `?length=` precondition, checked when it runs
    claim: Claim | None = None  # its idempotency key's claim (None: an append without a key)
    chunking: Chunking | None = None  # chunked prefill's progress (None: the whole append in one step)
    recompute: bool = False
    start: int = 0  # its first row in the step's x
    rows: int = 0  # its rows in the step (n, or length + n when recomputed; a chunk's when chunked)
    first: int = 0  # the work row its rows start at (chunked: rows before it were computed earlier)
    prefix: int = 0  # kept rows recomputed before the append's own (the session's length, or 0)
    final: bool = True  # its last rows: the commit applies the append (else it records progress)
    error: BaseException | None = None


class SessionRegistry:
    """Sessions of one gang (see the module docstring)."""

    def __init__(self, limits: Limits, owner: str, key: bytes | None = None) -> None:
        """`owner`: this gang's replica id (the prefix of every id it hands out); `key`: the
        app's session-id key (service.sessions.ids.app_key; None: a random one, so only this
        registry's own ids count as issued)."""
        self.limits = limits
        self.owner = owner
        self.ids = SessionIds(owner, key if key is not None else secrets.token_bytes(32))
        self._lock = threading.RLock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._ended: OrderedDict[str, str] = OrderedDict()  # id -> "expired" | "ended"
        self._free = list(range(limits.num_blocks - 1, -1, -1))  # a stack: low ids first
        self.evictions = 0
        self.recomputed_tokens = 0
        self.expired = 0
        self.opened = 0
        self.ended = 0
        self.appends = 0
        self.steps = 0

    # -- ids ---------------------------------------------------------------------------------
    def new_id(self) -> str:
        return self.ids.mint()

    # -- the event loop's side ----------------------------------------------------------------
    def open(self, session_id: str | None = None) -> Session:
        """A new empty session (429 at max_sessions); `session_id`: an OIP client's own id."""
        with self._lock:
            if len(self._sessions) >= self.limits.max_sessions:
                raise TooManySessions(
                    f"{len(self._sessions)} sessions are open on this gang (max_sessions={self.limits.max_sessions}); "
                    f"end some (DELETE /sessions/{{id}}) or wait for idle ones to expire "
                    f"(session_idle_timeout_s={self.limits.idle_timeout_s:g})")
            sid = session_id or self.new_id()
            if sid in self._sessions:
                raise Conflict(f"session {sid!r} is live: end it (sequence_end, DELETE) before starting it again", code=ErrorCode.SESSION_EXISTS)
            now = time.monotonic()
            s = Session(sid, time.time(), now, time.time())
            self._sessions[sid] = s
            self._ended.pop(sid, None)
            self.opened += 1
            return s

    def lookup(self, session_id: str) -> Session:
        """The live session, or: 410 session_lost (an id this app issued, held by a gang that is
        gone: service.sessions.ids), 404 session_expired (ended by the idle timeout), 404
        session_not_found (any other id: ended, or never issued)."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is not None:
                return s
            why = self._ended.get(session_id)
        if why == "expired":
            raise NotFound(f"session {session_id!r} expired: idle longer than session_idle_timeout_s="
                           f"{self.limits.idle_timeout_s:g}", code=ErrorCode.SESSION_EXPIRED)
        issued = self.ids.issued(session_id) if why is None else None
        if issued is not None and issued.owner != self.owner:
            raise SessionGone(
                f"session {session_id!r} was held by gang {issued.owner!r}, which is gone (this gang is "
                f"{self.owner!r}); its state was lost with that gang's rank 0: open a new session")
        if why is None and issued is None and not session_id.startswith(OIP_PREFIX):
            raise NotFound(f"no session {session_id!r}: not an id this app issued (ids come from POST /sessions)",
                           code=ErrorCode.SESSION_NOT_FOUND)
        raise NotFound(f"no session {session_id!r} on this gang (never opened, or ended)",
                       code=ErrorCode.SESSION_NOT_FOUND)

    def close(self, session_id: str, why: str = "ended") -> Session:
        with self._lock:
            s = self.lookup(session_id)
            self._drop(s, why)
            return s

    def check_append(self, s: Session, rows: int) -> None:
        """Refuse (no state change) an append the limits can never allow."""
        total = s.length + rows
        if total > self.limits.max_session_tokens:
            raise InvalidInput(
                f"session {s.id!r} has {s.length} tokens; {rows} more would make {total}, past "
                f"max_session_tokens={self.limits.max_session_tokens}; nothing was appended",
                code=ErrorCode.SESSION_TOO_LONG)
        need = self.limits.blocks_for(total)
        if need > self.limits.num_blocks:
            raise SessionCacheFull(
                f"session {s.id!r} would need {need} KV blocks of {self.limits.block_size} tokens for {total} "
                f"tokens; one rank's whole cache holds {self.limits.num_blocks} (session_cache_bytes); nothing "
                "was appended")

    # -- idempotency keys (see the module docstring) ---------------------------------------------
    def admit(self, s: Session, key: str, digest: bytes) -> Admission:
        """A keyed append to `s` arrives: its remembered answer, the claim of its earlier try
        still in flight, or a new claim of its own (409 `idempotency_key_reused` when the key
        was used on this session for other rows)."""
        with self._lock:
            kept = s.answers.get(key)
            if kept is not None:
                self._check_digest(s, key, kept.digest, digest, "was answered")
                s.last_used, s.last_used_at = time.monotonic(), time.time()
                return Admission(kept=kept)
            claim = s.claims.get(key)
            if claim is not None:
                self._check_digest(s, key, claim.digest, digest, "is being appended")
                return Admission(claim=claim)
            claim = s.claims[key] = Claim(s, key, digest)
            return Admission(claim=claim, first=True)

    def kept(self, s: Session, key: str, digest: bytes) -> KeptAnswer | None:
        """`s`'s remembered answer for `key` (409 for other rows), or None."""
        with self._lock:
            kept = s.answers.get(key)
            if kept is not None:
                self._check_digest(s, key, kept.digest, digest, "was answered")
            return kept

    def withdraw(self, claim: Claim) -> None:
        """The claim's caller is done with it (answered, failed or gone): if no step planned it
        yet none ever will (planning skips it), and it is settled as not appended. Otherwise
        (planned or settled) nothing changes: its step's commit or abort settles it."""
        with self._lock:
            if claim.state is ClaimState.WAITING:
                self._settle(claim, appended=False)

    async def settled(self, claim: Claim, until: float) -> bool:
        """Wait until `claim` is settled (True), or until `until` (time.monotonic(): False)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            if claim.state is ClaimState.SETTLED:
                return True
            claim._waiters.append((loop, done))
        try:
            await asyncio.wait_for(done, timeout=max(0.0, until - time.monotonic()))
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                if (loop, done) in claim._waiters:
                    claim._waiters.remove((loop, done))

    def _check_digest(self, s: Session, key: str, had: bytes, has: bytes, what: str) -> None:
        if had != has:
            raise Conflict(
                f"Idempotency-Key {key!r} {what} on session {s.id!r} for other rows (a different digest of "
                f"their bytes, shape and dtype); a key names one append: send a new key for new rows. "
                f"Nothing was appended", code=ErrorCode.IDEMPOTENCY_KEY_REUSED)

    def _settle(self, claim: Claim, appended: bool) -> None:
        """Under the lock: `claim` is certain now; its key leaves the session's claims and
        whoever waits on it is woken."""
        claim.state, claim.appended = ClaimState.SETTLED, appended
        if claim.session.claims.get(claim.key) is claim:
            del claim.session.claims[claim.key]
        for loop, done in claim._waiters:
            try:
                loop.call_soon_threadsafe(_resolve, done)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass
        claim._waiters = []

    def _keep(self, s: Session, claim: Claim, rows: np.ndarray, info: dict[str, Any]) -> None:
        """Under the lock, with the append itself: remember the claim's answer (the oldest
        beyond answers_kept forgotten) and settle it as appended."""
        kept = np.array(rows, dtype=np.float32, copy=True)
        kept.setflags(write=False)
        s.answers[claim.key] = KeptAnswer(claim.digest, kept, info)
        s.answers.move_to_end(claim.key)
        while len(s.answers) > self.limits.answers_kept:
            s.answers.popitem(last=False)
        self._settle(claim, appended=True)

    def expire_idle(self, now: float | None = None) -> int:
        """End the sessions idle past idle_timeout_s (none with an append queued or running)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [s for s in self._sessions.values()
                    if not s.busy and now - s.last_used > self.limits.idle_timeout_s]
            for s in idle:
                self._drop(s, "expired")
            self.expired += len(idle)
            return len(idle)

    def _drop(self, s: Session, why: str) -> None:
        self._sessions.pop(s.id, None)
        self._free.extend(reversed(s.blocks))
        s.blocks, s.cached, s.inputs = [], 0, []
        s.answers = OrderedDict()  # in-flight claims settle when their step finds the session gone
        self._ended[s.id] = why
        self._ended.move_to_end(s.id)
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        if why == "ended":
            self.ended += 1

    def is_live(self, s: Session) -> bool:
        with self._lock:
            return self._sessions.get(s.id) is s

    # -- the sequencer's side: one step ---------------------------------------------------------
    def plan(self, items: list[StepItem], generation: int, version: int) -> "RegistryStep":
        """Place `items` (distinct sessions) for one step on the gang as it is now."""
        with self._lock:
            try:
                return self._plan(items, generation, version)
            except BaseException:
                for item in items:  # no step runs: nothing of it is appended
                    if item.claim is not None and item.claim.state is not ClaimState.SETTLED:
                        self._settle(item.claim, appended=False)
                raise

    def _plan(self, items: list[StepItem], generation: int, version: int) -> "RegistryStep":
        """`plan`'s body, under the lock: a withdrawn, ended or mismatched item is answered
        (not appended) and its claim settled; the rest are placed and their claims PLANNED."""
        live = []
        for item in items:
            if item.chunking is not None and item.chunking.abandoned:
                item.error = DeadlineExceededBeforeStep(
                    "the append was abandoned between its chunks (its caller had gone); nothing was appended")
            elif item.claim is not None and item.claim.state is ClaimState.SETTLED:
                item.error = DeadlineExceededBeforeStep(
                    "the append was withdrawn before its step (its caller had gone); nothing was appended")
            elif not self.is_live(item.session):
                item.error = NotFound(f"session {item.session.id!r} ended before its append ran; nothing "
                                      "was appended", code=ErrorCode.SESSION_NOT_FOUND)
            elif item.expect_length is not None and item.expect_length != item.session.length:
                item.error = Conflict(
                    f"session {item.session.id!r} has length {item.session.length}, the append expected "
                    f"{item.expect_length}; nothing was appended", code=ErrorCode.SESSION_LENGTH_MISMATCH)
            else:
                live.append(item)
                if item.claim is not None:
                    item.claim.state = ClaimState.PLANNED
                continue
            if item.claim is not None and item.claim.state is not ClaimState.SETTLED:
                self._settle(item.claim, appended=False)
        pinned = {item.session.id for item in live}
        xs, new_rows, cached, tables, at = [], [], [], [], 0
        for item in live:
            s, n = item.session, int(item.x.shape[0])
            ch = item.chunking
            if ch is not None and ch.done and not (ch.generation, ch.version, ch.evictions) == (
                    generation, version, s.evictions):
                ch.done, ch.outputs = 0, []  # its chunks' K/V are gone or stale: start the work again
            if ch is None or not ch.done:  # the append's first step (or its restart)
                valid = s.generation == generation and s.version == version and s.cached == s.length
                recompute, base = not valid and s.length > 0, s.length if valid else 0
                if ch is not None:
                    ch.recompute, ch.base, ch.generation, ch.version = recompute, base, generation, version
            else:
                recompute, base = ch.recompute, ch.base
            item.recompute = recompute
            prefix = item.prefix = s.length if recompute else 0  # kept rows recomputed before its own
            work = prefix + n
            first = ch.done if ch is not None else 0
            rows = work - first if ch is None else min(ch.chunk, work - first)
            self._grow(s, self.limits.blocks_for(s.length + n), pinned)  # the whole append's, at once
            if ch is not None:
                ch.evictions, ch.in_step = s.evictions, True
            # the step's rows: work rows first .. first + rows (kept rows, then the append's own)
            if first < prefix:
                xs.append(s.kept()[first:min(prefix, first + rows)])
            if first + rows > prefix:
                xs.append(item.x[max(0, first - prefix):first + rows - prefix])
            item.start, item.rows, item.first, item.final = at, rows, first, first + rows == work
            at += rows
            new_rows.append(rows)
            cached.append(base + first)
            tables.append(tuple(s.blocks[:self.limits.blocks_for(base + first + rows)]))
        plan = AppendPlan(self.limits.num_blocks, self.limits.block_size, tuple(new_rows), tuple(cached),
                          tuple(tables))
        plan.check()  # here, before any header goes out: a rank must never refuse a plan mid-step
        x = np.concatenate(xs) if len(xs) > 1 else (xs[0] if xs else np.zeros((0, 0), np.float32))
        return RegistryStep(self, live, items, plan, x, generation, version)

    def _grow(self, s: Session, need: int, pinned: set[str]) -> None:
        """Give `s` `need` blocks in all, evicting unpinned sessions (LRU, idle first) if needed."""
        short = need - len(s.blocks)
        if short <= 0:
            return
        if len(self._free) < short:
            order = [v for v in self._sessions.values() if v.id not in pinned and v.blocks]
            order.sort(key=lambda v: (v.busy > 0, v.last_used))  # idle before queued, then LRU
            for victim in order:
                if len(self._free) >= short:
                    break
                self._free.extend(reversed(victim.blocks))
                victim.blocks, victim.cached = [], 0
                victim.evictions += 1
                self.evictions += 1
        if len(self._free) < short:
            raise SessionCacheFull(
                f"session {s.id!r} needs {short} more KV blocks; {len(self._free)} are free and the rest hold "
                f"sessions of this very step (num_blocks={self.limits.num_blocks})")
        for _ in range(short):
            s.blocks.append(self._free.pop())

    def _commit(self, step: "RegistryStep", out: np.ndarray) -> list[tuple[np.ndarray | None, dict[str, Any] | BaseException | Chunking]]:
        """After the step: each final item's append applied (its answer kept with it), each
        chunk before the last recorded (its answer: its `Chunking`, to be queued again)."""
        now, wall = time.monotonic(), time.time()
        with self._lock:
            self.steps += 1
            answers: dict[int, np.ndarray] = {}
            for item in step.live:
                s, n = item.session, int(item.x.shape[0])
                ch = item.chunking
                if ch is not None:
                    ch.in_step = False
                if self._sessions.get(s.id) is not s:  # ended while the step ran: nothing to keep
                    item.error = NotFound(f"session {s.id!r} ended while its append ran",
                                          code=ErrorCode.SESSION_NOT_FOUND)
                    if item.claim is not None:
                        self._settle(item.claim, appended=False)
                    continue
                own = self._own_rows(item, out)
                s.last_used, s.last_used_at = now, wall
                if not item.final:
                    assert ch is not None
                    ch.outputs.append(own)
                    ch.done += item.rows
                    ch.steps += 1
                    if item.recompute:
                        s.cached = 0  # its blocks hold part of a recompute: not valid for its length
                    if ch.abandoned and item.claim is not None:  # its caller is gone: nothing appended
                        self._settle(item.claim, appended=False)
                    continue
                answers[id(item)] = np.concatenate([*ch.outputs, own]) if ch is not None and ch.outputs else own
                if item.recompute:
                    s.recomputed_tokens += s.length
                    self.recomputed_tokens += s.length
                s.inputs.append(np.array(item.x, dtype=np.float32, copy=True))
                s.length += n
                s.cached, s.generation, s.version = s.length, step.generation, step.version
                s.appends += 1
                self.appends += 1
                self._sessions.move_to_end(s.id)
            results: list[tuple[np.ndarray | None, dict[str, Any] | BaseException | Chunking]] = []
            for item in step.items:
                if item.error is not None:
                    results.append((None, item.error))
                    continue
                if not item.final:
                    assert item.chunking is not None
                    results.append((None, item.chunking))
                    continue
                rows = np.ascontiguousarray(answers[id(item)])
                info = {**self.public(item.session), "recomputed_tokens_this_append": item.prefix}
                if item.claim is not None:  # remembered in the same critical section as the append
                    self._keep(item.session, item.claim, rows, info)
                results.append((rows, info))
        return results

    @staticmethod
    def _own_rows(item: StepItem, out: np.ndarray) -> np.ndarray:
        """The outputs of `item`'s rows in this step that are the append's own (not recomputed
        kept rows): work rows max(first, prefix) .. first + rows of the step's out."""
        skip = max(0, item.prefix - item.first)
        return np.array(out[item.start + skip:item.start + item.rows], dtype=np.float32, copy=True)

    def _abort(self, step: "RegistryStep") -> None:
        with self._lock:
            for item in step.live:
                item.session.cached = 0  # the step may have written part of its blocks: recompute next time
                if item.chunking is not None:
                    item.chunking.in_step = False
                    item.chunking.done, item.chunking.outputs = 0, []
                if item.claim is not None:  # nothing of the step was appended
                    self._settle(item.claim, appended=False)

    def abandon(self, s: Session, chunking: Chunking, claim: Claim | None) -> None:
        """A chunked append's caller gave up between (or during) its chunks: plan no more of it,
        and settle its claim as not appended, now, or, while one of its chunks is in a step, at
        that step's end (a last chunk's step then applies the append, as any append whose
        caller went away while its step ran). Its blocks stay the session's; a recompute's
        partial K/V was already marked invalid (cached = 0)."""
        with self._lock:
            chunking.abandoned = True
            if not chunking.in_step and claim is not None and claim.state is not ClaimState.SETTLED:
                self._settle(claim, appended=False)

    # -- reading --------------------------------------------------------------------------------
    def public(self, s: Session) -> dict[str, Any]:
        """GET /sessions/{id}: length, weights version, created, last used, bytes held."""
        blocks = len(s.blocks)
        return {
            "session_id": s.id, "length": s.length, "weights_version": s.version,
            "created_at": s.created_at, "last_used_at": s.last_used_at,
            "cached_tokens": s.cached, "kv_blocks": blocks,
            "kv_bytes_per_rank": blocks * self.limits.block_size * self.limits.bytes_per_token,
            "input_bytes": int(sum(a.nbytes for a in s.inputs)),
            "appends": s.appends, "recomputed_tokens": s.recomputed_tokens, "evictions": s.evictions,
            "idle_timeout_s": self.limits.idle_timeout_s,
            "answers_kept": len(s.answers), "answer_bytes": int(sum(a.rows.nbytes for a in s.answers.values())),
        }

    def stats(self) -> dict[str, Any]:
        with self._lock:
            used_blocks = self.limits.num_blocks - len(self._free)
            tokens = sum(s.cached for s in self._sessions.values() if s.blocks)
            lim = self.limits
            block_bytes = lim.block_size * lim.bytes_per_token
            return {
                "active": len(self._sessions), "max_sessions": lim.max_sessions,
                "max_session_tokens": lim.max_session_tokens, "idle_timeout_s": lim.idle_timeout_s,
                "block_tokens": lim.block_size, "num_blocks": lim.num_blocks, "free_blocks": len(self._free),
                "bytes_per_token_per_rank": lim.bytes_per_token,
                "capacity_bytes_per_rank": lim.num_blocks * block_bytes,
                "used_bytes_per_rank": used_blocks * block_bytes,
                "cached_tokens": tokens,
                "kept_input_bytes": int(sum(a.nbytes for s in self._sessions.values() for a in s.inputs)),
                "evictions": self.evictions, "recomputed_tokens": self.recomputed_tokens,
                "expired": self.expired, "opened": self.opened, "ended": self.ended,
                "appends": self.appends, "append_steps": self.steps,
            }


class RegistryStep:
    """A planned step (service.gang.gang.SessionStepPlan): x, the encoded plan, commit/abort."""

    def __init__(self, registry: SessionRegistry, live: list[StepItem], items: list[StepItem], plan: AppendPlan,
                 x: np.ndarray, generation: int, version: int) -> None:
        self._registry, self.live, self.items = registry, live, items
        self.plan, self.x, self.generation, self.version = plan, x, generation, version
        self.sessions = plan.sessions
        self.meta = plan.encode()

    def commit(self, out: np.ndarray) -> list[tuple[np.ndarray | None, dict[str, Any] | BaseException]]:
        return self._registry._commit(self, out)

    def abort(self) -> None:
        self._registry._abort(self)


def _resolve(done: asyncio.Future) -> None:
    if not done.done():
        done.set_result(None)
