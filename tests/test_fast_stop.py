"""Stopping an app with nothing to drain is quick (issue 43).

A gang that was never placed (its placement group cannot be reserved: more GPU ranks than
the cluster has) holds nothing; deleting its app must not wait out Serve's
graceful_shutdown_timeout_s for the GangServer replica that never started
(service.cluster.unplaced: the app's Controller kills it once Serve deletes the app).
"""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from service.app import compose_app, parse_args
from service.cluster import unplaced
from service.config.tunables import Tunables
from tests.conftest import local_yaml_args
from tests.helpers import eventually

GRACE_S = Tunables().gang.graceful_shutdown_timeout_s


@pytest.mark.ray
def test_deleting_an_app_whose_gang_was_never_placed_returns_at_once(serve_url: str) -> None:
    # 4 GPU ranks, one per node, on the test cluster's 2 nodes of 1 GPU: never placeable. Built
    # past the preflight check (as after nodes left), so the app runs and answers 503.
    cfg = parse_args({**local_yaml_args(), "use_gpu": True, "backend": "auto", "cpus_per_rank": 0.25,
                      "world_size": 4, "placement_strategy": "STRICT_SPREAD"})
    serve._run(compose_app(cfg), name="unplaced", route_prefix="/unplaced", _blocking=False)  # noqa: SLF001
    base = serve_url + "/unplaced"
    eventually(lambda: (r := httpx.get(base + "/readyz", timeout=10)).status_code == 503
               and r.json().get("code") == "unschedulable", 120, "the app answering 503 unschedulable")
    time.sleep(4 * Tunables().fleet.watch_interval_s)  # the Controller looked several times meanwhile ...
    assert len(unplaced.pending_gangs("unplaced")) == 1  # ... and left the live app's pending gang alone
    t0 = time.monotonic()
    serve.delete("unplaced")  # blocking: returns once every replica of the app is gone
    took = time.monotonic() - t0
    print(f"serve.delete of an app with an unplaced gang: {took:.1f} s (GangServer grace {GRACE_S:g} s)")
    assert took < GRACE_S / 2, f"serve.delete took {took:.1f} s; the never-placed gang waited out Serve's grace"
    assert "unplaced" not in serve.status().applications

    # The app's JobManager stopped its poll loop in Serve's graceful shutdown, before its
    # replica's thread pool closed under it (each late round logged "job poll failed").
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"  # noqa: SLF001
    manager_logs = [p.read_text(errors="replace") for p in logs.glob("replica_unplaced_JobManager_*.log")]
    assert manager_logs, f"no JobManager log of the app among {sorted(p.name for p in logs.glob('replica_unplaced_*'))}"
    assert all("stopped polling" in text and "job poll failed" not in text for text in manager_logs), manager_logs
