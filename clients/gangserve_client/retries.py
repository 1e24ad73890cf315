"""One retry policy for every call, sync and async, built on `stamina` (jittered exponential
backoff over tenacity, bounded by attempts and by total time).

Retried:

- a 503 or 429 reply that carries `Retry-After` (the gang is starting or rebuilding, a queue
  is full): the wait is the longer of Retry-After and the exponential backoff, plus jitter,
  capped at `wait_max_s`. A 429 without Retry-After (`quota_exceeded`) is not retried;
- a connection that could not be made (`httpx.ConnectError`, `ConnectTimeout`, `PoolTimeout`:
  nothing was sent), for every call;
- a connection dropped after the request was (maybe) sent (`ReadError`, `WriteError`,
  `RemoteProtocolError`), only for idempotent calls (GETs, inference and session appends,
  never a job submission, upload, cancel or weights swap);
- a timeout waiting for the reply (`ReadTimeout`, `WriteTimeout`), only for keyed calls: a
  session append, which carries an `Idempotency-Key` (the same on every attempt), so the
  service answers a retry of an append it already made with that append's answer and
  appends nothing.

Any other timeout waiting for the reply is never retried: the service is slow, and asking
again would only add load. What is left after the last attempt is raised: the typed
`GangServeHTTPError`, or `ServiceUnreachableError` for a connection error.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import httpx
import stamina

from gangserve_client.errors import GangServeHTTPError, ServiceUnreachableError, error_of

RETRY_STATUSES = (429, 503)
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_DROPPED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
_TIMED_OUT = (httpx.ReadTimeout, httpx.WriteTimeout)


@dataclass(frozen=True)
class RetryPolicy:
    """How hard one call tries. `retries` extra attempts, all of them within `timeout_s`
    (None: no time bound) from the first; waits grow from `wait_initial_s` by 2x per
    attempt, plus up to `wait_jitter_s` at random, never over `wait_max_s`."""

    retries: int = 3
    timeout_s: float | None = 60.0
    wait_initial_s: float = 0.25
    wait_max_s: float = 10.0
    wait_jitter_s: float = 0.5

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0; got {self.retries}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None; got {self.timeout_s}")

    def backoff_s(self, failures: int) -> float:
        """Exponential backoff before attempt `failures + 1`, with jitter, capped."""
        base = self.wait_initial_s * 2 ** (failures - 1)
        return min(self.wait_max_s, base + random.uniform(0, self.wait_jitter_s))

    def _context(self, hook: "_Backoff") -> Any:
        return stamina.retry_context(
            on=hook, attempts=self.retries + 1, timeout=self.timeout_s, wait_initial=self.wait_initial_s,
            wait_max=self.wait_max_s, wait_jitter=self.wait_jitter_s,
        )


class _Backoff:
    """stamina's backoff hook for one call: False (raise it now), or the seconds to wait."""

    def __init__(self, policy: RetryPolicy, idempotent: bool, keyed: bool = False) -> None:
        self.policy, self.idempotent, self.keyed, self.failures = policy, idempotent, keyed, 0

    def __call__(self, exc: Exception) -> bool | float:
        if isinstance(exc, GangServeHTTPError):
            if exc.status not in RETRY_STATUSES or exc.retry_after_s is None:
                return False
            floor = min(exc.retry_after_s, self.policy.wait_max_s)
        elif (isinstance(exc, _NOT_SENT) or ((self.idempotent or self.keyed) and isinstance(exc, _DROPPED))
              or (self.keyed and isinstance(exc, _TIMED_OUT))):
            floor = 0.0
        else:
            return False
        self.failures += 1
        return max(floor, self.policy.backoff_s(self.failures))


def _checked(reply: httpx.Response) -> httpx.Response:
    if not reply.is_success:
        raise error_of(reply)
    return reply


def _unreachable(exc: httpx.TransportError, method: str, url: str) -> ServiceUnreachableError:
    return ServiceUnreachableError(f"{method} {url}: {type(exc).__name__}: {exc}")


def send(http: httpx.Client, policy: RetryPolicy, method: str, path: str, *, idempotent: bool,
         keyed: bool = False, **kwargs: Any) -> httpx.Response:
    """One call with `policy`'s retries; the 2xx reply, or the typed error. `keyed`: the call
    carries an idempotency key in its (unchanged) headers, so a timed-out attempt is retried."""
    try:
        for attempt in policy._context(_Backoff(policy, idempotent, keyed)):
            with attempt:
                return _checked(http.request(method, path, **kwargs))
    except httpx.TransportError as exc:
        raise _unreachable(exc, method, str(http.base_url).rstrip("/") + path) from exc
    raise AssertionError("unreachable: stamina raises after the last attempt")


async def asend(http: httpx.AsyncClient, policy: RetryPolicy, method: str, path: str, *, idempotent: bool,
                keyed: bool = False, **kwargs: Any) -> httpx.Response:
    """As `send`, for httpx.AsyncClient."""
    try:
        async for attempt in policy._context(_Backoff(policy, idempotent, keyed)):
            with attempt:
                return _checked(await http.request(method, path, **kwargs))
    except httpx.TransportError as exc:
        raise _unreachable(exc, method, str(http.base_url).rstrip("/") + path) from exc
    raise AssertionError("unreachable: stamina raises after the last attempt")
