"""Feasibility rules of service.cluster.placement (pure functions, no Ray)."""
from __future__ import annotations

import pytest

from service.cluster.placement import (
    ClusterSnapshot,
    GangRequest,
    GangUnschedulable,
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
