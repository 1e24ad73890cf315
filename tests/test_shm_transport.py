"""The same-node shared-memory hand-off between the ingress and the GangServer (service.transport.shm).

Unit tests of the file lifecycle, the GangServer side through a real Serve handle (the test
process shares /dev/shm with every raylet of the local test cluster), and the full HTTP
path with its transport counters. Expected outputs come from tests.reference.
"""
from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from service.contract.gang_status import dump
from service.transport import shm
from tests.reference import reference, relative_error
from tests.helpers import npy_bytes, rand

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm (Linux)")


def gangserve_files() -> set[str]:
    return {p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}*")}


@pytest.mark.unit
def test_round_trip_reply_in_place_and_unlink() -> None:
    x = rand(2, 3, 8).astype(np.float64)  # any float dtype is copied in as float32
    ref, mine = shm.create(x, node_id="n1")
    assert ref.shape == (2, 3, 8) and ref.nbytes == 2 * 3 * 8 * 4
    assert mine.dtype == np.float32 and np.array_equal(mine, x.astype(np.float32))
    theirs = shm.open_ref(ref, node_id="n1")
    assert np.array_equal(theirs, mine)
    theirs[...] = 7.0  # the GangServer writes the reply into the same pages
    assert np.all(mine == 7.0)
    shm.unlink(ref)
    assert ref.name not in gangserve_files()
    theirs[0, 0, 0] = 1.0  # both mappings outlive the name
    assert mine[0, 0, 0] == 1.0
    with pytest.raises(shm.SharedMemoryUnavailable, match="cannot open"):
        shm.open_ref(ref, node_id="n1")


@pytest.mark.unit
def test_refuses_other_nodes_and_foreign_names() -> None:
    ref, _ = shm.create(np.zeros((1, 1, 4), np.float32), node_id="n1")
    try:
        with pytest.raises(shm.SharedMemoryUnavailable, match="on node n1, this is node n2"):
            shm.open_ref(ref, node_id="n2")
        forged = shm.SharedTensorRef(name="../etc/passwd", shape=(1,), node_id="n1")
        with pytest.raises(shm.SharedMemoryUnavailable, match="not a gangserve"):
            shm.open_ref(forged, node_id="n1")
    finally:
        shm.unlink(ref)


@pytest.mark.unit
def test_sweep_removes_only_files_of_dead_processes() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = shm.SHM_DIR / f"{shm.PREFIX}{int(dead.stdout)}-{'0' * 16}"
    stale.write_bytes(b"left behind")
    live_ref, _ = shm.create(np.ones((1, 1, 4), np.float32), node_id="n1")
    try:
        assert shm.sweep_stale() >= 1
        names = gangserve_files()
        assert stale.name not in names and live_ref.name in names
    finally:
        shm.unlink(live_ref)
        stale.unlink(missing_ok=True)


@pytest.mark.ray
def test_gang_server_reads_and_replies_through_shared_memory(app_url: str) -> None:
    from ray import serve

    handle = serve.get_deployment_handle("GangServer", app_name="gangserve")
    node_id = httpx.get(app_url + "/gang", timeout=30).json()["ranks"][0]["node_id"]
    x = rand(2, 16, 512, seed=11)
    ref, view = shm.create(x, node_id=node_id)
    try:
        shape = handle.infer_shared.remote(ref).result(timeout_s=60)
        assert tuple(shape) == x.shape
        assert relative_error(torch.from_numpy(view.copy()), reference(x)) < 1e-5
        # A ref from another node is refused (the ingress then sends by value).
        elsewhere = shm.SharedTensorRef(name=ref.name, shape=ref.shape, node_id="f" * 56)
        with pytest.raises(Exception, match="on node f+, this is node"):
            handle.infer_shared.remote(elsewhere).result(timeout_s=60)
    finally:
        shm.unlink(ref)


@pytest.mark.ray
def test_http_requests_use_shared_memory_on_one_node_and_leave_no_files(app_url: str) -> None:
    before_files = gangserve_files()
    before = httpx.get(app_url + "/gang", timeout=30).json()
    transport = before["ingress_transport"]
    same_node = transport["node_id"] == before["ranks"][0]["node_id"]
    big, small = rand(4, 16, 512, seed=12), rand(1, 4, 512, seed=13)  # 128 KiB, 8 KiB
    for x in (big, small):
        r = httpx.post(app_url + "/infer", content=npy_bytes(x), headers={"content-type": "application/x-npy"}, timeout=60)
        assert r.status_code == 200, r.text
        out = np.load(io.BytesIO(r.content))
        assert relative_error(torch.from_numpy(out), reference(x)) < 1e-5
    after = httpx.get(app_url + "/gang", timeout=30).json()["ingress_transport"]
    assert after["shm_enabled"] is True
    # The small request always goes by value; the big one through /dev/shm iff the ingress
    # and the GangServer (rank 0) share a node, and then both over the data channel
    # (service.transport.channel) instead of a handle call.
    assert after["shared_memory"] - transport["shared_memory"] == (1 if same_node else 0), (transport, after)
    assert after["data_channel"] - transport["data_channel"] == (2 if same_node else 0), (transport, after)
    assert after["object_store"] - transport["object_store"] == (0 if same_node else 2), (transport, after)
    assert after["shared_memory_fallbacks"] == transport["shared_memory_fallbacks"]
    assert gangserve_files() <= before_files


def _driver_side_client(app_url: str) -> tuple[Any, str]:
    """A real request policy (the ingress's code) in this test process, on a real handle, with
    the data channel off (tests/test_data_channel.py covers it): the tensor crosses the
    handle call, by value or through /dev/shm.

    Every raylet of the test cluster runs on this machine and shares /dev/shm, so the
    client may claim rank 0's node id: that makes the shared-memory branch deterministic
    whichever node Serve put the ingress replica on.
    """
    from ray import serve

    from service.config.builder_args import AppConfig
    from service.ingress.requests import connect
    from tests.conftest import local_yaml_args

    handle = serve.get_deployment_handle("GangServer", app_name="gangserve")
    rank0_node = httpx.get(app_url + "/gang", timeout=30).json()["ranks"][0]["node_id"]
    client = connect(handle, AppConfig.model_validate({**local_yaml_args(), "data_channel": False}),
                     node_id=rank0_node)
    return client, rank0_node


def _paths(client: Any) -> dict[str, int]:
    """The handle-call counters of a request policy's transport stats (its describe()'s
    ingress_transport, what GET /gang shows for an ingress replica)."""
    used = dump(asyncio.run(client.describe()))["ingress_transport"]
    return {k: used[k] for k in ("shared_memory", "object_store", "shared_memory_fallbacks")}


@pytest.mark.ray
def test_gang_client_hands_tensors_over_shared_memory(app_url: str) -> None:
    client, _ = _driver_side_client(app_url)
    big = rand(3, 32, 512, seed=14)  # 192 KiB

    async def run() -> np.ndarray:
        return await client.infer(big)

    out = asyncio.run(run())
    assert relative_error(torch.from_numpy(np.array(out)), reference(big)) < 1e-5
    assert _paths(client) == {"shared_memory": 1, "object_store": 0, "shared_memory_fallbacks": 0}
    assert not any(name.startswith(f"{shm.PREFIX}{os.getpid()}-") for name in gangserve_files())


@pytest.mark.ray
def test_gang_client_falls_back_to_the_object_store_when_shm_fails(app_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = _driver_side_client(app_url)
    monkeypatch.setattr(shm, "SHM_DIR", Path("/nonexistent-shm-dir"))  # as if /dev/shm were gone or full
    big = rand(3, 32, 512, seed=15)

    async def run() -> list[np.ndarray]:
        return [await client.infer(big), await client.infer(big)]

    first, second = asyncio.run(run())
    for out in (first, second):
        assert relative_error(torch.from_numpy(np.array(out)), reference(big)) < 1e-5
    # One failed attempt, then by value without retrying shared memory for a while.
    assert _paths(client) == {"shared_memory": 0, "object_store": 2, "shared_memory_fallbacks": 1}


@pytest.mark.ray
def test_rank_death_during_shared_memory_requests_is_a_clean_error_and_leaves_no_files(app_url: str) -> None:
    """kill -9 of rank 1 while shm requests flow: every request gets its exact rows (those the
    dying gang could not answer are retried once it is rebuilt, issue 23), no /dev/shm file
    outlives its call, and the rebuilt gang serves through shared memory again."""
    from tests.faults import gang_client_around_kill, wait_for_new_gang

    client, _ = _driver_side_client(app_url)
    victim = httpx.get(app_url + "/gang", timeout=30).json()["ranks"][1]["pid"]
    x = rand(2, 64, 512, seed=16)  # 256 KiB
    want = reference(x)
    outcomes = gang_client_around_kill(client, x, want, victim)
    print("shm requests around kill -9 of rank 1:", {c: outcomes.count(c) for c in set(outcomes)})
    assert set(outcomes) == {"ok"}, outcomes
    assert client.retries >= 1, "no request met the broken gang: the kill came too late"
    assert not [n for n in gangserve_files() if n.startswith(f"{shm.PREFIX}{os.getpid()}-")]
    wait_for_new_gang(app_url, {victim}, timeout_s=60)
    fresh, _ = _driver_side_client(app_url)
    assert relative_error(torch.from_numpy(np.array(asyncio.run(fresh.infer(x)))), want) < 1e-5
    assert _paths(fresh)["shared_memory"] == 1
