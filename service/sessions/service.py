"""What the GangServer does for sessions: open, append, read, end, expire, report.

Rank 0's process owns it (the registry, the batcher, the idle sweeper); the gang runs the
steps (service.gang.gang.Gang.session_step). Every answer names the weights version its
rows were computed with; a step never mixes versions (the registry recomputes a session
whose cached K/V is of another version or generation, see service.sessions.registry).

Loss of rank 0's process (the GangServer replica): the registry, and with it every kept
input, dies with it; the replica that replaces it has another replica id, so the old ids
answer 410 `session_lost` (the id names the gang that held it, and its tag shows this app
issued it: service.sessions.ids). docs/design.md says why.
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
from service.contract.errors import Conflict, ErrorCode, InvalidInput
from service.contract.gang_status import SessionCacheRank, SessionStats
from service.gang.gang import Gang
from service.parallel.model import kv_bytes_per_token
from service.parallel.registry import resolve
from service.sessions.batcher import AppendBatcher
from service.sessions.ids import OIP_PREFIX
from service.sessions.registry import Limits, RegistryStep, SessionRegistry, StepItem

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
                  bytes_per_token=per_token)


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
            num_blocks=self.limits.num_blocks, blocks_for=self.limits.blocks_for, wait_s=cfg.batching.batch_wait_timeout_s)
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
    async def open(self, x: np.ndarray | None, deadline: float | None,
                   session_id: str | None = None) -> tuple[np.ndarray | None, dict[str, Any]]:
        """A new session, with `x` [n, E] as its first rows (their outputs returned) or empty."""
        self._require_enabled()
        s = self.registry.open(session_id)
        if x is None or not len(x):
            return None, self.registry.public(s)
        try:
            return await self.append(s.id, x, deadline)
        except BaseException:
            if s.length == 0:  # the prefill failed: no half-open session is left behind
                self.registry.close(s.id)
            raise

    async def append(self, session_id: str, x: np.ndarray, deadline: float | None,
                     length: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """x [n, E] float32 -> (output rows [n, E], the session's info after the append)."""
        self._require_enabled()
        s = self.registry.lookup(session_id)
        if x.ndim != 2 or x.shape[1] != self._cfg.model.embed_dim or x.shape[0] < 1:
            raise InvalidInput(f"an append takes rows [n, {self._cfg.model.embed_dim}] with n >= 1; got "
                               f"{list(x.shape)}")
        if length is not None and length != s.length:
            raise Conflict(f"session {s.id!r} has length {s.length}, the append expected {length}; "
                           "nothing was appended", code=ErrorCode.SESSION_LENGTH_MISMATCH)
        self.registry.check_append(s, int(x.shape[0]))
        context = s.length
        started = time.perf_counter()
        rows, info = await self._batcher.submit(s, np.ascontiguousarray(x, dtype=np.float32), deadline, length)
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
                  deadline: float | None) -> tuple[np.ndarray, dict[str, Any]]:
        """Triton's sequence semantics: `start` opens `sequence_id` (409 if it is live), the
        rows are appended, `end` ends it after this request."""
        sid = sequence_id if sequence_id.startswith(OIP_PREFIX) else OIP_PREFIX + sequence_id
        if start:
            rows, info = await self.open(x, deadline, session_id=sid)
        else:
            rows, info = await self.append(sid, x, deadline)
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
        return SessionStats(**reg, per_rank=per_rank, batching=self._batcher.stats(),
                            append_latency_ms_p50_by_context=latency)

    # -- internals -------------------------------------------------------------------------------
    def _require_enabled(self) -> None:
        if self.limits.num_blocks < 1:
            raise Conflict(f"sessions are off on this app (session_cache_bytes={self._cfg.sessions.session_cache_bytes} "
                           f"holds no block of {self.limits.block_size} tokens)", code=ErrorCode.CONFLICT)

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
