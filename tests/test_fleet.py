"""The Controller's fleet view (service.state.fleet): which gangs count as serving, and when."""
from __future__ import annotations

import pytest

from service.contract.gang_status import GangRow, GangStatus
from service.config.tunables import FleetTunables

from service.state import fleet as f
from tests.statuses import gang_report


def ready(**fields: object) -> GangStatus:
    """A ready gang's report at weights version 3 (`fields` change it)."""
    return gang_report(**{"weights_version": 3, **fields})


READY = ready()


@pytest.mark.unit
def test_a_ready_report_counts_until_it_goes_stale() -> None:
    fleet = f.Fleet()
    fleet.report(ready(replica_id="A"), 100.0)
    view = fleet.view(100.5)
    assert view.ready == 1 and view.gangs[0].replica_id == "A"
    assert view.gangs[0].weights_version == 3
    stale = fleet.view(100.0 + FleetTunables().stale_after_s + 0.1)
    assert stale.ready == 0
    assert stale.gangs[0].state == "unreachable" and "no report for" in stale.gangs[0].reason
    fleet.report(ready(replica_id="A"), 100.0 + FleetTunables().stale_after_s + 0.2)  # it reports again: serving again
    assert fleet.view(100.0 + FleetTunables().stale_after_s + 0.3).ready == 1


@pytest.mark.unit
def test_a_lost_gang_never_counts_again_and_is_named() -> None:
    fleet = f.Fleet()
    fleet.report(ready(replica_id="A"), 100.0)
    fleet.report(ready(replica_id="B"), 100.0)
    fleet.mark_lost("A", "its replica process died", 100.2)
    fleet.report(ready(replica_id="A"), 100.3)  # a report that was in flight when it died
    view = fleet.view(100.4)
    assert [g.replica_id for g in view.gangs] == ["B"] and view.ready == 1
    assert [g.model_dump() for g in view.lost] == [{"replica_id": "A", "reason": "its replica process died", "s_ago": 0.2}]
    assert fleet.view(100.2 + FleetTunables().lost_kept_s + 1).lost == []


@pytest.mark.unit
def test_unreachable_and_broken_gangs_are_shown_with_their_state() -> None:
    fleet = f.Fleet()
    fleet.report(ready(replica_id="A"), 10.0)
    fleet.report(ready(replica_id="B", state="rebuilding", reason="rank 1 died"), 10.0)
    fleet.mark_unreachable("A", 10.1)
    view = fleet.view(10.5)
    states = {g.replica_id: (g.state, g.code) for g in view.gangs}
    assert states == {"A": ("unreachable", "gang_unreachable"), "B": ("rebuilding", None)}
    assert view.ready == 0
    fleet.mark_reachable("A")
    assert fleet.view(10.6).ready == 1


@pytest.mark.unit
def test_withdrawn_and_long_silent_gangs_leave_the_view() -> None:
    fleet = f.Fleet()
    fleet.report(ready(replica_id="A"), 0.0)
    fleet.report(ready(replica_id="B"), 0.0)
    fleet.withdraw("A")
    assert [g.replica_id for g in fleet.view(1.0).gangs] == ["B"]
    assert fleet.view(FleetTunables().fold_after_s + 1).gangs == []


@pytest.mark.unit
def test_the_version_moves_on_what_a_request_path_acts_on_and_only_then() -> None:
    """Controller.watch_fleet wakes its long polls when `version` moves: on a new gang, a
    change of state, generation, weights or placement, a loss, a withdrawal, a gang that turns
    unreachable or reachable, or one that reports again after going stale; never on a report
    that only refreshes counters."""
    fleet = f.Fleet()
    seen = [fleet.version]

    def moved() -> bool:
        seen.append(fleet.version)
        return seen[-1] != seen[-2]

    fleet.report(ready(replica_id="A"), 0.0)
    assert moved()  # a new gang
    fleet.report(ready(replica_id="A", step_timings={"steps": 5}), 1.0)
    assert not moved()  # the same gang, only its counters changed
    fleet.report(ready(replica_id="A", state="rebuilding", reason="rank 1 died"), 2.0)
    assert moved()
    fleet.report(ready(replica_id="A", generation=2), 3.0)
    assert moved()  # back to ready, in a new generation
    fleet.report(ready(replica_id="A", generation=2, weights_version=4), 4.0)
    assert moved()
    fleet.mark_unreachable("A", 4.5)
    assert moved()
    fleet.mark_unreachable("A", 4.6)
    assert not moved()  # still unreachable
    fleet.mark_reachable("A")
    assert moved()
    fleet.report(ready(replica_id="A", generation=2, weights_version=4), 4.0 + FleetTunables().stale_after_s + 1)
    assert moved()  # it had gone stale: serving again is news
    fleet.report(ready(replica_id="B"), 20.0)
    fleet.withdraw("B")
    assert moved()
    fleet.withdraw("B")
    assert not moved()  # nothing was there
    fleet.mark_lost("A", "its replica process died", 21.0)
    assert moved()


@pytest.mark.unit
def test_the_long_poll_wakes_when_a_serving_gang_would_turn_stale() -> None:
    fleet = f.Fleet()
    assert fleet.next_stale_s(0.0) == float("inf")  # no gang: nothing to wake for
    fleet.report(ready(replica_id="A"), 10.0)
    fleet.report(ready(replica_id="B"), 12.0)
    assert fleet.next_stale_s(11.0) == pytest.approx(FleetTunables().stale_after_s - 1.0 + 0.01)  # A's report ages first
    fleet.report(ready(replica_id="A", state="broken", reason="rank 1 died"), 13.0)
    assert fleet.next_stale_s(13.0) == pytest.approx(FleetTunables().stale_after_s - 1.0 + 0.01)  # only B serves


@pytest.mark.ray
def test_the_ingress_follows_the_controllers_pushed_view(app_url: str) -> None:
    """Controller.watch_fleet answers a caller behind the current version at once; a real
    request policy (the ingress's code, here in the test process) follows that long poll and
    then reads the gang's status from the pushed view: the gang that GET /gang describes."""
    import asyncio
    import time

    import httpx
    from ray import serve

    from service.config.builder_args import AppConfig
    from service.ingress.fleet_client import FleetClient
    from service.contract.gang_status import GangRow, GangStatus
    from service.ingress.requests import connect
    from tests.conftest import local_yaml_args

    controller = serve.get_deployment_handle("Controller", app_name="gangserve")
    version = controller.fleet.remote().result(timeout_s=30).version
    behind = controller.watch_fleet.remote(version - 1, 30.0).result(timeout_s=10)  # at once, not after 30 s
    assert behind.version >= version and [g.state for g in behind.gangs] == ["ready"], behind

    config = AppConfig.model_validate(local_yaml_args())
    fleet = FleetClient(controller, config)
    client = connect(serve.get_deployment_handle("GangServer", app_name="gangserve"), config, fleet)

    async def follow() -> object:
        await client.status.read(max_age_s=1.0)  # the first read starts the follower
        deadline = time.monotonic() + 30
        while fleet.pushed_gang(single_gang=True) is None:
            assert time.monotonic() < deadline, "the client never received a pushed status"
            await asyncio.sleep(0.05)
        return await client.status.read(max_age_s=1.0)

    pushed = asyncio.run(follow())
    assert isinstance(pushed, GangRow) and pushed is fleet.pushed_gang(single_gang=True), pushed
    gang = httpx.get(app_url + "/gang", timeout=30).json()
    assert (pushed.replica_id, pushed.state, pushed.generation) == \
        (gang["replica_id"], "ready", gang["generation"]), (pushed, gang)
