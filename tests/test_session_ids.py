"""Session ids outside the registry: the owner the request router reads from an id
(service.sessions.ids.named_owner, the one parser), the cluster's session-id key keeper
(service.sessions.ids.app_key, on a real Ray), and why an app has no sessions."""
from __future__ import annotations

import dataclasses
import secrets
import threading
from typing import Any

import pytest

from service.config.builder_args import AppConfig
from service.gang.router import session_affinity
from service.sessions.ids import OIP_PREFIX, SessionIds, app_key, named_owner
from service.sessions.service import limits_of, why_sessions_are_off


@pytest.mark.unit
def test_the_router_reads_the_owner_of_our_ids_only() -> None:
    minted = SessionIds("gang_A1", secrets.token_bytes(32)).mint()
    legacy = f"gang_A1-{secrets.token_hex(12)}"  # before tags
    assert named_owner(minted) == named_owner(legacy) == "gang_A1"
    for other in (OIP_PREFIX + minted, f"{OIP_PREFIX}my-seq", "nosuch-0123", "has-dash-" + minted, "", minted + "0"):
        assert named_owner(other) is None, other


class _Replica:
    """What session_affinity reads of Serve's RunningReplica: its id."""

    def __init__(self, unique_id: str) -> None:
        self.replica_id = type("ReplicaID", (), {"unique_id": unique_id})()


@pytest.mark.unit
def test_affinity_sends_our_ids_to_their_gang_and_an_oip_id_to_one_stable_gang() -> None:
    a, b = _Replica("gangA"), _Replica("gangB")
    mine = SessionIds("gangB", secrets.token_bytes(32)).mint()
    assert session_affinity(mine, [a, b]) == [b]  # type: ignore[arg-type]
    assert session_affinity(mine, [a]) is None  # type: ignore[arg-type]  # its gang is gone
    oip = f"{OIP_PREFIX}gangB-{secrets.token_hex(12)}"  # an OIP client's id shaped like ours names no gang
    chosen = session_affinity(oip, [a, b])  # type: ignore[arg-type]
    assert chosen is not None and len(chosen) == 1 and chosen == session_affinity(oip, [b, a])  # type: ignore[arg-type]


@pytest.mark.unit
def test_a_model_without_a_cache_is_named_not_the_cache_budget() -> None:
    config = AppConfig()
    limits = limits_of(config)
    assert limits.num_blocks > 0 and why_sessions_are_off(limits, config) is None
    no_cache = dataclasses.replace(limits, num_blocks=0, bytes_per_token=0)  # what limits_of gives such a model
    why = why_sessions_are_off(no_cache, config)
    assert why is not None and "model 'attention'" in why and "keeps none" in why
    assert "session_cache_bytes" not in why
    no_budget = dataclasses.replace(limits, num_blocks=0)
    why = why_sessions_are_off(no_budget, config)
    assert why is not None and f"session_cache_bytes={config.sessions.session_cache_bytes}" in why


@pytest.mark.ray
def test_every_caller_of_an_app_gets_one_key_and_each_app_its_own(ray_cluster: Any) -> None:
    """On the suite's cluster (a second `ray.init` in this process would fail): app names of
    its own, so the keys of the suite's apps are never touched."""
    one, two = (f"test-ids-{secrets.token_hex(4)}" for _ in range(2))
    keys: list[bytes] = []

    def ask() -> None:
        keys.append(app_key(one))

    callers = [threading.Thread(target=ask) for _ in range(4)]  # gangs starting together
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    assert len(keys) == 4 and len(set(keys)) == 1 and len(keys[0]) == 32
    assert app_key(one) == keys[0] and app_key(two) != keys[0]


@pytest.mark.ray
def test_the_key_outlives_the_placement_group_of_the_gang_that_asked_first(ray_cluster: Any) -> None:
    """A gang's Serve replica runs in the gang's placement group, child tasks captured (Serve's
    `placement_group_bundles`). The keeper that replica starts must live outside that group: else
    it dies with the gang, the app's next gang makes another key, and an earlier gang's ids answer
    404 instead of 410. A keeper of this test's own name, so the suite's apps' keys are untouched."""
    import time

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from service.sessions.ids import KEEPER_NAMESPACE

    keeper, app = f"test-keeper-{secrets.token_hex(4)}", f"test-ids-{secrets.token_hex(4)}"

    @ray.remote(num_cpus=0.01, max_restarts=0)
    class FirstGang:
        def key(self) -> bytes:
            return app_key(app, keeper_name=keeper)

    group = placement_group([{"CPU": 0.01}])
    ray.get(group.ready(), timeout=120)
    gang = FirstGang.options(scheduling_strategy=PlacementGroupSchedulingStrategy(  # type: ignore[attr-defined]
        group, placement_group_capture_child_tasks=True)).remote()
    try:
        key = ray.get(gang.key.remote(), timeout=120)
        remove_placement_group(group)  # the gang's replica stops: its group goes, with what ran in it
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ray.get(gang.key.remote(), timeout=10)
            except ray.exceptions.RayActorError:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the first gang's actor outlived its placement group by 60 s")
        # Asked again for 2 s: a keeper that died with the group answers an error or a new key.
        asked_until = time.monotonic() + 2
        while time.monotonic() < asked_until:
            assert app_key(app, timeout_s=60, keeper_name=keeper) == key
            time.sleep(0.2)
    finally:
        ray.kill(gang, no_restart=True)
        try:
            ray.kill(ray.get_actor(keeper, namespace=KEEPER_NAMESPACE), no_restart=True)
        except ValueError:  # never started, or already gone
            pass
