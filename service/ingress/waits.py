"""A request's bounded pause, and the count of requests the ingress dropped before sending them."""
from __future__ import annotations

import asyncio
import enum
import time

from service.contract.errors import DeadlineExceeded
from service.metrics.process import process_metrics


class DropReason(str, enum.Enum):
    """Why the ingress dropped a request before sending it (/metrics' gangserve_requests_dropped)."""

    DEADLINE = "deadline"  # its deadline passed while it waited
    DISCONNECTED = "disconnected"  # its client went away while it waited for a gang


def count_drop(reason: DropReason) -> None:
    process_metrics().inc("gangserve_requests_dropped", ("ingress", reason.value))


def declare_drops() -> None:
    """Every reason at 0, so /metrics shows the series before the first drop."""
    for reason in DropReason:
        process_metrics().inc("gangserve_requests_dropped", ("ingress", reason.value), 0.0)


async def pause(delay: float, deadline: float, doing: str) -> None:
    """Sleep `delay`, or until `deadline` (monotonic) and then raise 504 deadline_exceeded
    (saying what the request was doing)."""
    left = deadline - time.monotonic()
    if left <= delay:
        await asyncio.sleep(max(0.0, left))
        count_drop(DropReason.DEADLINE)
        raise DeadlineExceeded(f"the request's deadline passed while {doing}")
    await asyncio.sleep(delay)
