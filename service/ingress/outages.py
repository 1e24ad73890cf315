"""How long the gang's current outage is expected to last, from the last one this ingress saw."""
from __future__ import annotations

import time

from service.contract.errors import ErrorCode, GangUnavailable


class OutageEstimate:
    """An outage runs from the first retryable failure (or wait for a gang) until a request is
    served again. A request that the gang is not expected back for before its deadline gets
    503 `deadline_unmeetable` at once: the expected wait is the last outage's length (or
    `default_outage_s` before any) less the time the current one has lasted."""

    def __init__(self, default_outage_s: float) -> None:
        self._default_outage_s = default_outage_s
        self._since: float | None = None  # time.monotonic() of the current outage's first failure
        self._last_s: float | None = None  # how long the last one lasted

    def saw_failure(self) -> None:
        if self._since is None:
            self._since = time.monotonic()

    def served(self) -> None:
        """A request was served: the outage (if any) is over, and its length is the next estimate."""
        if self._since is not None:
            self._last_s, self._since = time.monotonic() - self._since, None

    def expected_wait_s(self) -> float:
        since = self._since if self._since is not None else time.monotonic()
        return max(0.0, self._last_outage_s() - (time.monotonic() - since))

    def check(self, why: str, deadline: float) -> None:
        """503 `deadline_unmeetable` (with the expected wait as Retry-After) when the gang is not
        expected back before `deadline` (monotonic); `why`: what the gang is doing, in words."""
        expected = self.expected_wait_s()
        left = deadline - time.monotonic()
        if expected > left:
            raise GangUnavailable(
                f"no gang can serve now ({why}); one is expected in ~{expected:.1f}s (the last outage lasted "
                f"{self._last_outage_s():.1f}s), after this request's deadline ({left:.2f}s left)",
                code=ErrorCode.DEADLINE_UNMEETABLE, retry_after_s=max(1.0, round(expected)))

    def _last_outage_s(self) -> float:
        return self._last_s if self._last_s is not None else self._default_outage_s
