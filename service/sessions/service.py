"""What the GangServer does for sessions: open, append, read, end, expire, report.

Rank 0's process owns it (the registry, the batcher, the idle sweeper); the gang runs the
steps (service.gang.gang.Gang.session_step). Every answer names the weights version its
rows were computed with; a step never mixes versions (the registry recomputes a session
whose cached K/V is of another version or generation, see service.sessions.registry).

Loss of rank 0's process (the GangServer replica): the registry, and with it every kept
input, dies with it; the replica that replaces it has another replica id, so the old ids
answer 410 `session_lost` (the id names the gang that held it, and its tag shows this app
issued it: service.sessions.ids). docs/design.md says why.

Exactly-once appends (issue 52): an append with an idempotency key (service.sessions.keys;
the ingress gives every append one) is admitted by the registry first, before its
`?length=` precondition and its limits: a remembered key answers the first answer again
(`replayed`: true) and appends nothing; a key whose first append is still in flight waits
for that one to settle, at most until the retry's own deadline (then 504
`deadline_exceeded`, nothing appended by the retry), and looks again: the first's answer,
or, when the first appended nothing, this retry runs as the first. A retry of an append
whose session has ended since is 404 like any call on it.
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from typing import Any, Callable

import numpy as np

from service.config.builder_args import AppConfig
from service.contract.errors import Conflict, DeadlineExceeded, ErrorCode, GangServeError, InvalidInput
from service.contract.gang_status import SessionAttention, SessionCacheRank, SessionStats
from service.gang.gang import Gang, SessionPool
from service.parallel.model import kv_bytes_per_token
from service.parallel.registry import resolve
from service.sessions.batcher import AppendBatcher
from service.sessions.ids import OIP_PREFIX
from service.sessions.keys import rows_digest
from service.sessions.registry import Claim, KeptAnswer, Limits, RegistryStep, Session, SessionRegistry, StepItem

log = logging.getLogger("gangserve.sessions")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SWEEP_PERIOD_S = 1.0
# Append latency by the session's context length before the append (GET /gang, /metrics).
CONTEXT_BUCKETS = (16, 128, 1024, 4096)


def context_bucket(length: int) -> str:
    for bound in CONTEXT_BUCKETS:
        if length <= bound:
            return f"le_{bound}"
    return f"gt_{CONTEXT_BUCKETS[-1]}"


def limits_of(cfg: AppConfig) -> Limits:
    """The pool's shape from the budget: bytes per token per rank = 2 x cached layers x (E / ws) x
    dtype bytes (service.parallel.model.kv_bytes_per_token); a model without a cache has no sessions."""
    per_token = kv_bytes_per_token(resolve(cfg.model), cfg.gang.world_size, DTYPE_BYTES[cfg.model.compute_dtype])
    num_blocks = cfg.sessions.session_cache_bytes // (per_token * cfg.sessions.session_block_tokens) if per_token else 0
    return Limits(num_blocks=num_blocks, block_size=cfg.sessions.session_block_tokens, max_sessions=cfg.sessions.max_sessions,
                  max_session_tokens=cfg.sessions.max_session_tokens, idle_timeout_s=cfg.sessions.session_idle_timeout_s,
                  bytes_per_token=per_token, answers_kept=cfg.tunables.gang.session_answers_kept)


def why_sessions_are_off(limits: Limits, cfg: AppConfig) -> str | None:
    """Why this app has no sessions (None: it has), of the two reasons: the served model keeps
    no K/V cache (no budget would help), or `session_cache_bytes` holds no block."""
    if limits.num_blocks >= 1:
        return None
    if limits.bytes_per_token == 0:
        return (f"sessions need a model that keeps a K/V cache; this app serves model {cfg.model.kind!r}, which "
                f"keeps none")
    return (f"sessions are off on this app (session_cache_bytes={cfg.sessions.session_cache_bytes} holds no block "
            f"of {limits.block_size} tokens of {limits.bytes_per_token} bytes each per rank)")


def pool_of(cfg: AppConfig) -> SessionPool | None:
    """The KV pool the gang allocates and compiles for at bring-up (None: sessions are off)."""
    limits = limits_of(cfg)
    return SessionPool(limits.num_blocks, limits.block_size) if limits.num_blocks > 0 else None


class SessionService:
    """Sessions of one gang."""

    def __init__(self, gang: Gang, cfg: AppConfig, owner: str, key: bytes | None = None,
                 on_append: Callable[[str, float], None] | None = None) -> None:
        """`owner`: the replica id; `key`: the app's session-id key (service.sessions.ids)."""
        self._gang = gang
        self._on_append = on_append  # (context bucket, seconds): the replica's metrics
        self._cfg = cfg
        self.limits = limits_of(cfg)
        self.registry = SessionRegistry(self.limits, owner, key)
        self._batcher = AppendBatcher(
            self._step, max_sessions_per_step=cfg.batching.max_batch_size, max_rows_per_step=cfg.serving.max_tokens_per_request,
            num_blocks=self.limits.num_blocks, blocks_for=self.limits.blocks_for, wait_s=cfg.batching.batch_wait_timeout_s,
            chunk_rows=max(0, cfg.tunables.gang.session_prefill_chunk_tokens),
            chunk_linger_s=max(0.0, cfg.tunables.gang.session_prefill_chunk_linger_s),
            chunk_step_ratio=cfg.tunables.gang.session_prefill_step_ratio, abandon=self.registry.abandon)
        self._latency: dict[str, deque[float]] = {}
        self._sweeper: asyncio.Task | None = None

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    @property
    def idle(self) -> bool:
        return self._batcher.idle

    # -- the API ----------------------------------------------------------------------------
    async def open(self, x: np.ndarray | None, deadline: float | None, session_id: str | None = None,
                   key: str | None = None) -> tuple[np.ndarray | None, dict[str, Any]]:
        """A new session, with `x` [n, E] as its first rows (their outputs returned) or empty;
        `key`: the first rows' idempotency key (an OIP `sequence_start`'s)."""
        self._require_enabled()
        s = self.registry.open(session_id)
        if x is None or not len(x):
            return None, self.registry.public(s)
        try:
            return await self.append(s.id, x, deadline, key=key)
        except BaseException:
            if s.length == 0:  # the prefill failed: no half-open session is left behind
                self.registry.close(s.id)
            raise

    async def append(self, session_id: str, x: np.ndarray, deadline: float | None, length: int | None = None,
                     key: str | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """x [n, E] float32 -> (output rows [n, E], the session's info after the append);
        `key`: its idempotency key (validated by the ingress, service.sessions.keys): see the
        module docstring."""
        self._require_enabled()
        s = self.registry.lookup(session_id)
        if x.ndim != 2 or x.shape[1] != self._cfg.model.embed_dim or x.shape[0] < 1:
            raise InvalidInput(f"an append takes rows [n, {self._cfg.model.embed_dim}] with n >= 1; got "
                               f"{list(x.shape)}")
        x = np.ascontiguousarray(x, dtype=np.float32)
        if key is None:
            return await self._append(s, x, deadline, length, None)
        digest = rows_digest(x)
        # Every wait here is bounded by the request's deadline (request_timeout_s without one).
        until = deadline if deadline is not None else time.monotonic() + self._cfg.serving.request_timeout_s
        while True:
            s = self.registry.lookup(session_id)  # again after a wait: it may have ended meanwhile
            admission = self.registry.admit(s, key, digest)
            if admission.kept is not None:
                return admission.kept.replay()
            assert admission.claim is not None
            if admission.first:
                break
            if not await self.registry.settled(admission.claim, until):
                raise DeadlineExceeded(
                    f"the request's deadline passed while an earlier try of this append (Idempotency-Key "
                    f"{key!r}) was still running; this try appended nothing: retry it with the same key")
        try:
            return await self._append(s, x, deadline, length, admission.claim)
        finally:
            self.registry.withdraw(admission.claim)  # never planned (refused, dropped, gone): never appended

    async def _append(self, s: Session, x: np.ndarray, deadline: float | None, length: int | None,
                      claim: Claim | None) -> tuple[np.ndarray, dict[str, Any]]:
        """One append to `s` through the batcher (after its key, if any, was admitted as the first)."""
        if length is not None and length != s.length:
            raise Conflict(f"session {s.id!r} has length {s.length}, the append expected {length}; "
                           "nothing was appended", code=ErrorCode.SESSION_LENGTH_MISMATCH)
        self.registry.check_append(s, int(x.shape[0]))
        context = s.length
        started = time.perf_counter()
        rows, info = await self._batcher.submit(s, x, deadline, length, claim)
        took, bucket = time.perf_counter() - started, context_bucket(context)
        self._latency.setdefault(bucket, deque(maxlen=512)).append(took)
        if self._on_append is not None:
            self._on_append(bucket, took)
        return rows, info

    def info(self, session_id: str) -> dict[str, Any]:
        return self.registry.public(self.registry.lookup(session_id))

    def close(self, session_id: str) -> dict[str, Any]:
        s = self.registry.close(session_id)
        return {**self.registry.public(s), "ended": True}

    async def oip(self, sequence_id: str, x: np.ndarray, start: bool, end: bool,
                  deadline: float | None, key: str | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """Triton's sequence semantics: `start` opens `sequence_id` (409 if it is live), the
        rows are appended, `end` ends it after this request. `key`: the request's idempotency
        key; a retried `start` whose first try opened the sequence gets that try's answer (a
        retried `end` whose first try ended it is 404, as the sequence is gone)."""
        sid = sequence_id if sequence_id.startswith(OIP_PREFIX) else OIP_PREFIX + sequence_id
        kept = self._kept_start(sid, x, key) if start else None
        if kept is not None:
            rows, info = kept.replay()
        elif start:
            rows, info = await self.open(x, deadline, session_id=sid, key=key)
        else:
            rows, info = await self.append(sid, x, deadline, key=key)
        if end:
            self.registry.close(sid)
            info = {**info, "ended": True}
        assert rows is not None
        return rows, info

    # -- status --------------------------------------------------------------------------------
    def stats(self) -> SessionStats:
        """GET /gang `sessions`: the registry's figures, each rank's cache, the batcher's counters."""
        reg = self.registry.stats()
        pool = self._gang.kv_pool_bytes()
        per_rank = [SessionCacheRank(rank=r, capacity_bytes=reg["capacity_bytes_per_rank"],
                                     used_bytes=reg["used_bytes_per_rank"], **({"allocated_bytes": pool} if r == 0 else {}))
                    for r in range(self._cfg.gang.world_size)]
        latency = {bucket: round(statistics.median(v) * 1000, 3) for bucket, v in sorted(self._latency.items()) if v}
        kernel = self._gang.session_attention
        attention = SessionAttention(path=kernel.path, reason=kernel.reason, compile_s=kernel.compile_s,
                                     compiled_shapes=kernel.shapes,
                                     prefill_chunk_tokens=max(0, self._cfg.tunables.gang.session_prefill_chunk_tokens))
        return SessionStats(**reg, per_rank=per_rank, batching=self._batcher.stats(),
                            append_latency_ms_p50_by_context=latency, attention=attention)

    # -- internals -------------------------------------------------------------------------------
    def _kept_start(self, sid: str, x: np.ndarray, key: str | None) -> KeptAnswer | None:
        """The remembered answer of a `sequence_start` with `key` on the live sequence `sid`."""
        if key is None:
            return None
        try:
            s = self.registry.lookup(sid)
        except GangServeError:
            return None  # not live: the start opens it
        return self.registry.kept(s, key, rows_digest(np.ascontiguousarray(x, dtype=np.float32)))

    def _require_enabled(self) -> None:
        why = why_sessions_are_off(self.limits, self._cfg)
        if why is not None:
            raise Conflict(why, code=ErrorCode.CONFLICT)

    async def _step(self, items: list[StepItem], deadline: float | None) -> list[tuple[Any, Any]]:
        def prepare(generation: int, version: int) -> RegistryStep:
            return self.registry.plan(items, generation, version)

        return await self._gang.session_step(prepare, deadline)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_PERIOD_S)
            try:
                n = self.registry.expire_idle()
                if n:
                    log.info("%d idle sessions expired (session_idle_timeout_s=%g)", n, self.limits.idle_timeout_s)
            except Exception:  # noqa: BLE001 - the sweeper must keep running
                log.exception("session expiry failed")
