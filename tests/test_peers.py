"""PeerGroup.call (service.gang.peers): the one way rank 0 calls its peers, on real Ray actors.

The peers here are small Ray actors that answer, raise, hang or die on request (the gang's
rank actors are driven through the same calls by every gang test); what is checked is the
contract: results in rank order, every wait bounded, each failure named by its rank, a
dead peer reported at once, and the two ways to collect.
"""
from __future__ import annotations

import time
from typing import Any

import pytest

from service.gang.failures import PeerCallFailed, WeightsVersionMismatch, is_timeout, is_version_mismatch
from service.gang.peers import PeerGroup

pytestmark = pytest.mark.ray

SLOW_S = 30.0  # a hanging peer's sleep: far past every bound below


def _peers(ray_cluster: Any, behaviours: list[str], **kwargs: Any) -> tuple[PeerGroup, list]:
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class Peer:
        def __init__(self, rank: int, behaviour: str) -> None:
            self.rank, self.behaviour = rank, behaviour

        def answer(self, x: int) -> tuple[int, int]:
            if self.behaviour == "raise":
                raise ValueError(f"rank {self.rank} refuses {x}")
            if self.behaviour == "hang":
                time.sleep(SLOW_S)
            return self.rank, x

        def step_error(self, seq: int) -> RuntimeError | None:  # as service.gang.worker.Rank answers it
            if self.behaviour == "refuse":
                return WeightsVersionMismatch(f"rank {self.rank} holds weights version 1, the step expected {seq}")
            if self.behaviour == "loop failed":
                return RuntimeError(f"rank {self.rank}: step {seq} failed: a message naming the weights version")
            return None

    actors = [Peer.remote(rank, b) for rank, b in enumerate(behaviours, start=1)]
    ray.get([a.__ray_ready__.remote() for a in actors], timeout=60)
    return PeerGroup(actors, **{"stage_timeout_s": 20.0, **kwargs}), actors


def test_results_come_in_rank_order_from_every_peer_or_the_ranks_asked(ray_cluster: Any) -> None:
    group, _ = _peers(ray_cluster, ["ok", "ok", "ok"])
    assert group.call("answer", 7, stage="test") == [(1, 7), (2, 7), (3, 7)]
    assert group.call("answer", 8, stage="test", ranks=[3, 1]) == [(3, 8), (1, 8)]
    with pytest.raises(ValueError, match="rank 4 is not a peer of this gang"):
        group.call("answer", 9, stage="test", ranks=[4])


def test_a_peer_that_raises_fails_the_call_at_once_named_by_rank(ray_cluster: Any) -> None:
    group, _ = _peers(ray_cluster, ["hang", "raise"])
    started = time.monotonic()
    with pytest.raises(PeerCallFailed) as failed:
        group.call("answer", 1, stage="load")
    # The raising rank ends the wait: the hanging one is not waited for.
    assert time.monotonic() - started < SLOW_S / 2
    assert str(failed.value) == "stage 'load': rank 2: ValueError: rank 2 refuses 1"
    assert failed.value.failed == [2] and failed.value.late == [] and not is_timeout(failed.value)


def test_every_wait_is_bounded_and_names_the_late_ranks(ray_cluster: Any) -> None:
    group, _ = _peers(ray_cluster, ["ok", "hang", "hang"], stage_timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(PeerCallFailed) as failed:
        group.call("answer", 1, stage="rendezvous", diagnose=lambda: "bundle 2 is not placed")
    waited = time.monotonic() - started
    assert 1.5 <= waited < 6, waited
    assert str(failed.value) == ("stage 'rendezvous': rank 2: no answer within 1.5s; "
                                 "rank 3: no answer within 1.5s; bundle 2 is not placed")
    assert failed.value.late == [2, 3] and is_timeout(failed.value)
    # A caller's own bound may be shorter than the stage's, never longer.
    started = time.monotonic()
    with pytest.raises(PeerCallFailed, match="rank 2: no answer within 0.5s"):
        group.call("answer", 2, stage="probe", timeout_s=0.5)
    with pytest.raises(PeerCallFailed, match="rank 2: no answer within 1.5s"):
        group.call("answer", 3, stage="probe", timeout_s=60.0)
    assert time.monotonic() - started < 8


def test_a_dead_peer_is_named_and_reported_at_once(ray_cluster: Any) -> None:
    import ray

    died: list[tuple[int, str]] = []
    group, actors = _peers(ray_cluster, ["ok", "ok"], on_died=lambda g, rank, stage: died.append((rank, stage)))
    ray.kill(actors[0], no_restart=True)  # asynchronous: a call just after may still be answered
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actors[0].answer.remote(0), timeout=10)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the killed peer still answered after 30 s")
    started = time.monotonic()
    with pytest.raises(PeerCallFailed, match=r"stage 'probe': rank 1: its process died \("):
        group.call("answer", 1, stage="probe")
    assert time.monotonic() - started < 10
    assert died == [(1, "probe")]


def test_settle_collects_every_rank_without_raising(ray_cluster: Any) -> None:
    ticks: list[float] = []
    group, _ = _peers(ray_cluster, ["ok", "raise", "hang", "ok"], stage_timeout_s=1.5,
                      on_wait=lambda: ticks.append(time.monotonic()), wait_slice_s=0.25)
    settled = group.call("answer", 5, stage="stage weights", collect="settle")
    assert settled.results == {1: (1, 5), 4: (4, 5)}
    assert settled.failures == ["rank 2: ValueError: rank 2 refuses 5", "rank 3: no answer within 1.5s"]
    # While it waited, the caller's hook ran between slices (the gang's heartbeats)...
    assert len(ticks) >= 3, ticks
    # ... and not for a caller on another thread.
    ticks.clear()
    group.call("answer", 6, stage="step timings", timeout_s=0.5, collect="settle", tick=False)
    assert ticks == []


def test_a_refusal_crosses_ray_as_its_type_and_is_read_by_type(ray_cluster: Any) -> None:
    """`step_error` answers with the refusal itself: rank 0 reads a weights-version refusal by
    its type after the Ray hop, and a loop failure whose words mention weights is not one."""
    group, _ = _peers(ray_cluster, ["ok", "refuse", "loop failed"])
    none, refusal, failure = group.call("step_error", 7, stage="step error")
    assert none is None
    assert isinstance(refusal, WeightsVersionMismatch) and is_version_mismatch(refusal)
    assert "expected 7" in str(refusal)
    assert isinstance(failure, RuntimeError) and not is_version_mismatch(failure)
