"""Feasibility rules of service.cluster.placement (pure functions, no Ray)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from service.cluster.placement import (
    ClusterSnapshot,
    GangRequest,
    GangUnschedulable,
    SharedSnapshot,
    bundles_per_node,
    check_feasible,
    fits,
    waiting_reason,
)

pytestmark = pytest.mark.unit

TWO_GPU_NODES = [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]


def test_bundles_per_node_handles_fractions() -> None:
    assert bundles_per_node({"CPU": 2.0}, {"CPU": 0.25}) == 8
    assert bundles_per_node({"CPU": 2.0}, {"CPU": 0.5, "GPU": 1}) == 0
    assert bundles_per_node({"CPU": 0.9999999999}, {"CPU": 1.0}) == 1  # float noise


@pytest.mark.parametrize(
    ("world_size", "strategy", "ok"),
    [
        (2, "STRICT_SPREAD", True),
        (3, "STRICT_SPREAD", False),
        (2, "STRICT_PACK", False),  # each node has one GPU
        (1, "STRICT_PACK", True),
        (2, "PACK", True),
        (3, "PACK", False),
        (2, "SPREAD", True),
    ],
)
def test_gpu_gang_feasibility_per_strategy(world_size: int, strategy: str, ok: bool) -> None:
    assert fits(TWO_GPU_NODES, GangRequest(world_size, {"CPU": 1.0, "GPU": 1}, strategy)) is ok


def test_cpu_strict_pack_needs_one_big_node() -> None:
    nodes = [{"CPU": 2.0}, {"CPU": 2.0}]
    assert fits(nodes, GangRequest(4, {"CPU": 1.0}, "PACK"))
    assert not fits(nodes, GangRequest(4, {"CPU": 1.0}, "STRICT_PACK"))
    assert fits(nodes, GangRequest(4, {"CPU": 0.5}, "STRICT_PACK"))


def test_the_notes_scenario_message_names_both_sides() -> None:
    """4 ranks x 1 GPU on a 2-node, 2-GPU cluster: the original notes' hang."""
    snapshot = ClusterSnapshot(totals=TWO_GPU_NODES)
    with pytest.raises(GangUnschedulable) as info:
        check_feasible(snapshot, GangRequest(4, {"CPU": 1.0, "GPU": 1}, "STRICT_SPREAD"))
    message = info.value.message
    assert "gang needs 4 x {CPU: 1, GPU: 1} (STRICT_SPREAD)" in message
    assert "2 GPU on 2 nodes" in message
    assert info.value.status == 503


def test_no_gpu_cluster_says_zero_gpus() -> None:
    snapshot = ClusterSnapshot(totals=[{"CPU": 2.0}])
    with pytest.raises(GangUnschedulable, match=r"needs 2 x \{CPU: 1, GPU: 1\} \(PACK\); cluster has 2 CPU on 1 node, 0 GPU"):
        check_feasible(snapshot, GangRequest(2, {"CPU": 1.0, "GPU": 1}, "PACK"))


def test_waiting_reason_reports_free_resources() -> None:
    snapshot = ClusterSnapshot(totals=[{"CPU": 2.0}], free=[{"CPU": 0.5}])
    assert waiting_reason(snapshot, GangRequest(2, {"CPU": 1.0}, "PACK")) == (
        "waiting for 2 x {CPU: 1} (PACK); free now: 0.5 CPU on 1 node (1 alive node)"
    )


def test_a_stalled_cluster_read_bounds_every_waiter_and_is_read_once() -> None:
    """A GCS that stalls (here: a read blocked until released) costs each caller at most
    timeout_s, the stalled read is not repeated by the callers behind it, and once it
    answers, its snapshot serves them for max_age_s."""
    release, reads = threading.Event(), []
    snapshot = ClusterSnapshot(totals=[{"CPU": 2.0}], free=[{"CPU": 1.0}])

    def stalled_read() -> ClusterSnapshot:
        reads.append(time.monotonic())
        release.wait(10)
        return snapshot

    async def scenario() -> None:
        shared = SharedSnapshot(stalled_read, max_age_s=30.0, timeout_s=0.2)
        t0 = time.monotonic()
        got = await asyncio.gather(*(shared.get() for _ in range(5)))
        waited = time.monotonic() - t0
        assert got == [None] * 5 and waited < 2.0, (got, waited)
        assert "did not answer within 0.2s" in shared.why_none
        assert waiting_reason(None, GangRequest(2, {"CPU": 1.0}, "PACK"), shared.why_none) == (
            "waiting for 2 x {CPU: 1} (PACK); free resources unknown (Ray's GCS did not answer within 0.2s)")
        assert await shared.get() is None and len(reads) == 1  # still the one read in flight
        release.set()
        assert await shared.get() is snapshot
        assert await shared.get() is snapshot and len(reads) == 1  # fresh enough: not read again

    asyncio.run(scenario())


def test_a_failed_cluster_read_says_why_and_the_next_caller_reads_again() -> None:
    calls = []

    def read() -> ClusterSnapshot:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("GCS unreachable")
        return ClusterSnapshot(totals=[{"CPU": 2.0}])

    async def scenario() -> None:
        shared = SharedSnapshot(read, max_age_s=30.0, timeout_s=5.0)
        assert await shared.get() is None and "GCS unreachable" in shared.why_none
        assert (await shared.get()).totals == [{"CPU": 2.0}] and len(calls) == 2

    asyncio.run(scenario())
