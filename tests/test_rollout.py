"""POST /weights' wait for every gang (service.weights.rollout.wait_for_gangs), over the real
fleet view (service.state.fleet.Fleet) the Controller serves; the swaps themselves are
tested end to end in test_durable_weights.py, test_scale_out.py and test_training.py."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from service.contract.errors import ErrorCode, GangUnavailable
from service.contract.gang_status import FleetView, GangStatus
from service.state.fleet import Fleet
from service.weights.rollout import wait_for_gangs
from tests.statuses import gang_report

pytestmark = pytest.mark.unit


def _watch_of(fleet: Fleet):
    """What Controller.watch_fleet answers, over a real Fleet: the view once its version moved
    past `known` (the Controller's own wait is tested in test_fleet.py)."""
    async def watch(known: int) -> FleetView:
        while fleet.version == known:
            await asyncio.sleep(0.005)
        return fleet.view(time.time())
    return watch


def _ready(version: int, replica_id: str = "r1") -> GangStatus:
    return gang_report(weights_version=version, replica_id=replica_id)


def test_the_wait_ends_when_the_last_gang_reports_the_version() -> None:
    fleet = Fleet()
    fleet.report(_ready(4, "A"), time.time())
    fleet.report(_ready(3, "B"), time.time())

    async def scenario() -> tuple[bool, list[dict[str, Any]], float]:
        started = time.monotonic()
        # B follows the record 0.2 s into the wait: its report moves the fleet's version.
        asyncio.get_running_loop().call_later(0.2, lambda: fleet.report(_ready(4, "B"), time.time()))
        done, gangs = await wait_for_gangs(_watch_of(fleet), 4, timeout_s=10)
        return done, gangs, time.monotonic() - started

    done, gangs, waited = asyncio.run(scenario())
    assert done is True and 0.2 <= waited < 1.0, waited
    assert gangs == [{"replica_id": "A", "state": "ready", "weights_version": 4},
                     {"replica_id": "B", "state": "ready", "weights_version": 4}]


def test_the_wait_is_bounded_and_reports_where_each_gang_is() -> None:
    fleet = Fleet()
    fleet.report(_ready(4, "A"), time.time())
    fleet.report(_ready(3, "B"), time.time())

    started = time.monotonic()
    done, gangs = asyncio.run(wait_for_gangs(_watch_of(fleet), 4, timeout_s=0.5))
    assert 0.5 <= time.monotonic() - started < 2.0
    assert done is False and [g["weights_version"] for g in gangs] == [4, 3]


def test_a_fleet_view_that_cannot_be_read_is_never_taken_for_done() -> None:
    fleet = Fleet()
    fleet.report(_ready(4, "A"), time.time())
    watch_fleet = _watch_of(fleet)
    calls = 0

    async def watch(known: int) -> FleetView:
        nonlocal calls
        calls += 1
        if calls <= 2:  # the Controller restarts
            raise GangUnavailable("the controller did not answer watch_fleet", code=ErrorCode.CONTROLLER_UNREACHABLE)
        return await watch_fleet(known)

    done, gangs = asyncio.run(wait_for_gangs(watch, 4, timeout_s=10, retry_s=0.05))
    assert calls == 3 and done is True and gangs[0]["replica_id"] == "A"
    # Away for the whole wait: not rolled out, no gang listed.
    calls = -10**6
    assert asyncio.run(wait_for_gangs(watch, 4, timeout_s=0.3, retry_s=0.05)) == (False, [])
