"""The Controller's fleet view (service.state.fleet): which gangs count as serving, and when."""
from __future__ import annotations

import pytest

from service.state import fleet as f

READY = {"state": "ready", "reason": "ready", "world_size": 2, "backend": "gloo", "weights_version": 3}


@pytest.mark.unit
def test_a_ready_report_counts_until_it_goes_stale() -> None:
    fleet = f.Fleet()
    fleet.report("A", READY, 100.0)
    view = fleet.view(100.5)
    assert view["ready"] == 1 and view["gangs"][0]["replica_id"] == "A"
    assert view["gangs"][0]["weights_version"] == 3
    stale = fleet.view(100.0 + f.STALE_AFTER_S + 0.1)
    assert stale["ready"] == 0
    assert stale["gangs"][0]["state"] == "unreachable" and "no report for" in stale["gangs"][0]["reason"]
    fleet.report("A", READY, 100.0 + f.STALE_AFTER_S + 0.2)  # it reports again: serving again
    assert fleet.view(100.0 + f.STALE_AFTER_S + 0.3)["ready"] == 1


@pytest.mark.unit
def test_a_lost_gang_never_counts_again_and_is_named() -> None:
    fleet = f.Fleet()
    fleet.report("A", READY, 100.0)
    fleet.report("B", READY, 100.0)
    fleet.mark_lost("A", "its replica process died", 100.2)
    fleet.report("A", READY, 100.3)  # a report that was in flight when it died
    view = fleet.view(100.4)
    assert [g["replica_id"] for g in view["gangs"]] == ["B"] and view["ready"] == 1
    assert view["lost"] == [{"replica_id": "A", "reason": "its replica process died", "s_ago": 0.2}]
    assert fleet.view(100.2 + f.LOST_KEPT_S + 1)["lost"] == []


@pytest.mark.unit
def test_unreachable_and_broken_gangs_are_shown_with_their_state() -> None:
    fleet = f.Fleet()
    fleet.report("A", READY, 10.0)
    fleet.report("B", {**READY, "state": "rebuilding", "reason": "rank 1 died"}, 10.0)
    fleet.mark_unreachable("A", 10.1)
    view = fleet.view(10.5)
    states = {g["replica_id"]: (g["state"], g.get("code")) for g in view["gangs"]}
    assert states == {"A": ("unreachable", "gang_unreachable"), "B": ("rebuilding", None)}
    assert view["ready"] == 0
    fleet.mark_reachable("A")
    assert fleet.view(10.6)["ready"] == 1


@pytest.mark.unit
def test_withdrawn_and_long_silent_gangs_leave_the_view() -> None:
    fleet = f.Fleet()
    fleet.report("A", READY, 0.0)
    fleet.report("B", READY, 0.0)
    fleet.withdraw("A")
    assert [g["replica_id"] for g in fleet.view(1.0)["gangs"]] == ["B"]
    assert fleet.view(f.FOLD_AFTER_S + 1)["gangs"] == []
