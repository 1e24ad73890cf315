"""What the ingress may send a gang server again, declared per call, and the retrier that
follows the declaration.

A request that fails because its gang broke is sent again (at once with several gangs,
Serve's router picking a ready one; with one gang once it is ready again) while its
deadline allows. Whether that is safe depends on the call, so each call declares it in
`RETRY_TABLE` instead of a docstring assuming it:
- `idempotent`: running it twice leaves the same state and the same answer (an inference:
  every step runs on one weights version across ranks, service.gang; a session's info).
  It is retried after any retryable code (service.contract.errors.RETRYABLE_CODES: a rank
  died, a collective timed out, the gang is rebuilding or stopping, its replica is gone or
  restarting; never bad input, never the deadline).
- `needs_key`: not idempotent by itself, made exactly-once by an idempotency key
  (service.sessions.keys): a retryable failure may come after the gang server committed it
  (the answer lost on the way back), and the retry carries the same key, so the session
  answers the committed append's kept answer instead of appending again
  (service.sessions.registry). The caller makes a key before the first try when the client
  gave none; the retrier refuses to run such a call without one.
- neither (opening or closing a session): retried only after a code that says the gang
  server refused the call before running it (`REFUSED_BEFORE_RUNNING`), since a second
  open after a lost answer would hold a second session, and a second close answers 404.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Sequence, TypeVar

from service.contract.errors import RETRYABLE_CODES, ErrorCode, GangServeError
from service.ingress.waits import pause
from service.metrics.process import process_metrics

log = logging.getLogger("gangserve.ingress")
T = TypeVar("T")


class GangMethod(str, enum.Enum):
    """The GangServer methods a request calls (service.deployments.gang_server.GangServer)."""

    INFER = "infer"
    SESSION_OPEN = "session_open"
    SESSION_APPEND = "session_append"
    SESSION_OIP = "session_oip"  # an OIP sequence request: opens, appends, ends
    SESSION_INFO = "session_info"
    SESSION_CLOSE = "session_close"


# Codes a gang server answers before it runs the call: nothing of it happened (the gang is
# starting, rebuilding, stopped or not placed; the ranks' weights differed, so nothing was
# computed). The other retryable codes (a rank died mid-step, a collective timed out, the
# replica was lost mid-call) may come after the call took effect.
REFUSED_BEFORE_RUNNING: frozenset[ErrorCode] = frozenset({
    ErrorCode.GANG_STARTING, ErrorCode.GANG_REBUILDING, ErrorCode.GANG_STOPPED, ErrorCode.GANG_SCHEDULING,
    ErrorCode.WEIGHTS_VERSION_MISMATCH,
})
if not REFUSED_BEFORE_RUNNING <= RETRYABLE_CODES:
    raise ImportError(f"codes answered before running must be retryable: {sorted(REFUSED_BEFORE_RUNNING - RETRYABLE_CODES)}")


@dataclass(frozen=True)
class RetryRule:
    """One call's declaration (see the module docstring)."""

    idempotent: bool
    needs_key: bool
    retry_codes: frozenset[ErrorCode]

    def __post_init__(self) -> None:
        if not (self.idempotent or self.needs_key) and not self.retry_codes <= REFUSED_BEFORE_RUNNING:
            raise ValueError(f"a call that is neither idempotent nor keyed may be retried only after a code the gang "
                             f"answers before running it ({sorted(REFUSED_BEFORE_RUNNING)}); declared "
                             f"{sorted(self.retry_codes - REFUSED_BEFORE_RUNNING)} beyond them")
        if self.idempotent and self.needs_key:
            raise ValueError("an idempotent call needs no idempotency key")


_IDEMPOTENT = RetryRule(idempotent=True, needs_key=False, retry_codes=RETRYABLE_CODES)
_KEYED = RetryRule(idempotent=False, needs_key=True, retry_codes=RETRYABLE_CODES)
_ONCE = RetryRule(idempotent=False, needs_key=False, retry_codes=REFUSED_BEFORE_RUNNING)

RETRY_TABLE: Mapping[GangMethod, RetryRule] = {
    GangMethod.INFER: _IDEMPOTENT,
    GangMethod.SESSION_INFO: _IDEMPOTENT,
    GangMethod.SESSION_APPEND: _KEYED,
    GangMethod.SESSION_OIP: _KEYED,
    GangMethod.SESSION_OPEN: _ONCE,
    GangMethod.SESSION_CLOSE: _ONCE,
}
if set(RETRY_TABLE) != set(GangMethod):
    raise ImportError(f"every method the ingress calls declares its retries; undeclared: {set(GangMethod) - set(RETRY_TABLE)}")


class Retrier:
    """Tries a call again after the codes its rule declares, with backoff, until its deadline."""

    def __init__(self, backoff_s: Sequence[float]) -> None:
        if not backoff_s:
            raise ValueError("the retry backoff needs at least one delay; got none")
        self._backoff_s = tuple(backoff_s)
        self.retries = 0  # tries sent again (tests read it; the metric counts them too)

    async def run(self, method: GangMethod, try_once: Callable[[int], Awaitable[T]], deadline: float, *,
                  has_key: bool, before_retry: Callable[[GangServeError], None]) -> T:
        """`try_once(attempt)` (attempt 0, 1, ...) until it answers, sent again after a code
        `method`'s rule retries (after `before_retry(error)` and the backoff), while
        `deadline` (monotonic) allows: 504 deadline_exceeded once it passes meanwhile."""
        rule = RETRY_TABLE[method]
        if rule.needs_key and not has_key:
            raise ValueError(f"{method.value} is retried only with an idempotency key; the caller gave none")
        attempt = 0
        while True:
            try:
                return await try_once(attempt)
            except GangServeError as exc:
                if exc.code not in rule.retry_codes:
                    raise
                before_retry(exc)
                delay = self._backoff_s[min(attempt, len(self._backoff_s) - 1)]
                attempt += 1
                self.retries += 1
                process_metrics().inc("gangserve_request_retries", (exc.code,))
                log.info("retrying %s (attempt %d) after %s: %s", method.value, attempt + 1, exc.code, exc.message)
                await pause(delay, deadline, f"retrying after {exc.code}: {exc.message}")
