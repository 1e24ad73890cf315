"""Failpoints: named places where a test can make one rank fail for real, once.

Off unless the process was started with `GANGSERVE_FAILPOINTS=1` (the test suite sets it
before its Ray nodes start; production never does), so arming one in a deployed service is
refused. An armed failpoint fires at most once, in the process that armed it; the code
around it runs unchanged, which is what the fault tests exercise.
"""
from __future__ import annotations

import os
import threading

FAILPOINTS_ENV = "GANGSERVE_FAILPOINTS"

# Where a rank can be made to fail (see RankWorker):
#   stage_weights        staging a swap raises (as an unreadable checkpoint would)
#   commit_weights       committing a staged swap raises
#   commit_weights_noop  committing "succeeds" but the rank keeps its old weights
KNOWN = frozenset({"stage_weights", "commit_weights", "commit_weights_noop"})

# Where rank 0's process (the GangServer replica) can be made to lose a session append's
# answer after the append was committed (service.deployments.gang_server,
# service.transport.channel; armed with GangServer.arm_session_failpoint):
#   session_append_reply_dropped  the data channel closes the connection instead of writing
#                                 the reply (the ingress sees ChannelUnavailable, falls back)
#   session_append_answer_lost    the call answers a retryable 503 `gang_unavailable` instead
#                                 (the ingress's request policy retries it)
#   session_append_answer_late    the answer is held for LATE_S before it is sent (a client
#                                 whose own timeout is shorter gives up and retries)
SESSION_APPEND = frozenset({"session_append_reply_dropped", "session_append_answer_lost",
                            "session_append_answer_late"})
LATE_S = 4.0


class InjectedFault(RuntimeError):
    """Raised where an armed failpoint fires."""


class FailpointsDisabled(RuntimeError):
    """Arming was asked of a process started without GANGSERVE_FAILPOINTS=1."""


def enabled() -> bool:
    return os.environ.get(FAILPOINTS_ENV) == "1"


class Failpoints:
    """The armed failpoints of one process (thread-safe, one-shot)."""

    def __init__(self, known: frozenset[str] = KNOWN) -> None:
        """`known`: the names this process has (a rank's KNOWN, rank 0's server SESSION_APPEND)."""
        self._known = known
        self._armed: set[str] = set()
        self._lock = threading.Lock()

    def arm(self, name: str) -> None:
        if not enabled():
            raise FailpointsDisabled(f"failpoints are off (start the cluster with {FAILPOINTS_ENV}=1)")
        if name not in self._known:
            raise ValueError(f"unknown failpoint {name!r}; known: {sorted(self._known)}")
        with self._lock:
            self._armed.add(name)

    def take(self, name: str) -> bool:
        """True (once) if `name` is armed; disarms it."""
        with self._lock:
            if name in self._armed:
                self._armed.discard(name)
                return True
            return False

    def fire(self, name: str, where: str) -> None:
        """Raise InjectedFault if `name` is armed."""
        if self.take(name):
            raise InjectedFault(f"failpoint {name!r} fired on {where}")
