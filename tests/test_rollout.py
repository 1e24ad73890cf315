"""POST /weights' wait for every gang (service.weights.rollout.wait_for_gangs), over the real
fleet view (service.state.fleet.Fleet) the Controller serves; the swaps themselves are
tested end to end in test_durable_weights.py, test_scale_out.py and test_training.py."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from service.errors import ErrorCode, GangUnavailable
from service.state.fleet import Fleet
from service.weights.rollout import wait_for_gangs

pytestmark = pytest.mark.unit


def _ready(version: int) -> dict[str, Any]:
    return {"state": "ready", "reason": "ready", "world_size": 2, "backend": "gloo", "weights_version": version}


def test_the_wait_ends_when_every_gang_serves_the_version() -> None:
    fleet = Fleet()
    fleet.report("A", _ready(4), time.time())
    fleet.report("B", _ready(3), time.time())

    async def view() -> dict[str, Any]:
        if fleet.view(time.time())["gangs"][1]["weights_version"] == 3:
            fleet.report("B", _ready(4), time.time())  # B follows the record between two reads
        return fleet.view(time.time())

    done, gangs = asyncio.run(wait_for_gangs(view, 4, timeout_s=10, poll_s=0.05))
    assert done is True
    assert gangs == [{"replica_id": "A", "state": "ready", "weights_version": 4},
                     {"replica_id": "B", "state": "ready", "weights_version": 4}]


def test_the_wait_is_bounded_and_reports_where_each_gang_is() -> None:
    fleet = Fleet()
    fleet.report("A", _ready(4), time.time())
    fleet.report("B", _ready(3), time.time())

    async def view() -> dict[str, Any]:
        return fleet.view(time.time())

    started = time.monotonic()
    done, gangs = asyncio.run(wait_for_gangs(view, 4, timeout_s=0.5, poll_s=0.1))
    assert 0.5 <= time.monotonic() - started < 2.0
    assert done is False and [g["weights_version"] for g in gangs] == [4, 3]


def test_a_fleet_view_that_cannot_be_read_is_never_taken_for_done() -> None:
    fleet = Fleet()
    fleet.report("A", _ready(4), time.time())
    calls = 0

    async def view() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls <= 2:  # the Controller restarts
            raise GangUnavailable("the controller did not answer fleet", code=ErrorCode.CONTROLLER_UNREACHABLE)
        return fleet.view(time.time())

    done, gangs = asyncio.run(wait_for_gangs(view, 4, timeout_s=10, poll_s=0.05))
    assert calls == 3 and done is True and gangs[0]["replica_id"] == "A"
    # Away for the whole wait: not rolled out, no gang listed.
    calls = -10**6
    assert asyncio.run(wait_for_gangs(view, 4, timeout_s=0.3, poll_s=0.05)) == (False, [])
