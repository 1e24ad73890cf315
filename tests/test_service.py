"""End to end: real Ray, real Serve, real HTTP, real gloo process groups.

Every expected output comes from tests.reference (torch.nn.MultiheadAttention).
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from gangserve_client import GangServeClient
from service.contract.gang_status import IngressGangStatus, RankStatus
from tests.conftest import ROOT, deploy, local_yaml_args, undeploy
from tests.reference import reference, relative_error
from tests.helpers import assert_error, eventually, npy_bytes, pid_alive, rand

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("shape", [(3, 8, 512), (5, 512)])
def test_binary_formats_match_dense_reference(app_url: str, shape: tuple[int, ...]) -> None:
    x = rand(*shape, seed=len(shape))
    want = reference(x)
    r = httpx.post(app_url + "/infer", content=st_save({"hidden_states": x}),
                   headers={"content-type": "application/x-safetensors"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-safetensors"
    out_st = st_load(r.content)["output"]
    r = httpx.post(app_url + "/infer", content=npy_bytes(x), headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200, r.text
    out_npy = np.load(io.BytesIO(r.content), allow_pickle=False)
    for out in (out_st, out_npy):
        assert out.shape == shape and out.dtype == np.float32
        assert relative_error(torch.from_numpy(out), want) < 1e-5


def test_json_format_matches_dense_reference(app_url: str) -> None:
    x = rand(2, 4, 512, seed=3)
    r = httpx.post(app_url + "/infer", json={"hidden_states": x.tolist()}, timeout=60)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["shape"] == [2, 4, 512] and doc["dtype"] == "float32"
    assert relative_error(torch.tensor(doc["output"]), reference(x)) < 1e-5


def test_accept_header_chooses_reply_format(app_url: str) -> None:
    x = rand(1, 2, 512, seed=4)
    r = httpx.post(app_url + "/infer", json={"hidden_states": x.tolist()},
                   headers={"accept": "application/x-npy"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy"
    out = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert relative_error(torch.from_numpy(out), reference(x)) < 1e-5
    r = httpx.post(app_url + "/infer", json={"hidden_states": x.tolist()},
                   headers={"accept": "text/csv"}, timeout=60)
    assert_error(r, 406, "not_acceptable")


def test_notes_example_through_the_service(app_url: str) -> None:
    """manual_seed(42); randn(128, 8, 512) with seed weights: same out.mean() as dense."""
    torch.manual_seed(42)
    x = torch.randn(128, 8, 512)
    with GangServeClient(app_url) as client:
        out = client.infer(x.numpy())
    want = reference(x.numpy())
    assert relative_error(torch.from_numpy(out), want) < 1e-5
    assert out.astype(np.float64).mean() == pytest.approx(want.double().mean().item(), rel=1e-6)


def test_gang_shows_world_size_distinct_live_rank_processes(app_url: str) -> None:
    info = httpx.get(app_url + "/gang", timeout=30).json()
    assert info["world_size"] == 2 and info["backend"] == "gloo" and info["state"] == "ready"
    # The shared app's version depends on which tests swapped it before (any file order).
    assert info["weights_version"] >= 1 and info["weights_source"] in ("config", "swap")
    ranks = info["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    pids = {r["pid"] for r in ranks}
    assert len(pids) == 2
    for r in ranks:
        assert set(r) >= {"rank", "node_id", "node_ip", "pid", "device"}
        assert r["device"] == "cpu" and r["node_ip"]
        os.kill(r["pid"], 0)  # a live process on this machine
    # Each rank holds half of the projection weights (+ the replicated out bias).
    e = 512
    assert info["param_bytes_per_rank"] == [4 * (4 * e * e // 2 + 3 * e // 2 + e)] * 2
    # The typed contract (service.contract.gang_status) declares every key a live gang answers, and
    # the answer has every one of them (a ready gang behind an ingress sets them all).
    # /gang is the gang's report plus the ingress's own field; `memory`: CUDA ranks only
    declared = set(IngressGangStatus.model_fields) - {"memory"}
    assert set(info) == declared, (set(info) ^ declared)
    assert set(ranks[0]) == set(RankStatus.model_fields)
    assert httpx.get(app_url + "/healthz").status_code == 200
    assert httpx.get(app_url + "/readyz").json()["status"] == "ready"


def test_sixteen_concurrent_requests_are_all_correct(app_url: str) -> None:
    inputs = [rand(2, 1 + i % 5, 512, seed=100 + i) for i in range(16)]

    def call(x: np.ndarray) -> np.ndarray:
        r = httpx.post(app_url + "/infer", content=npy_bytes(x),
                       headers={"content-type": "application/x-npy"}, timeout=120)
        assert r.status_code == 200, r.text
        return np.load(io.BytesIO(r.content), allow_pickle=False)

    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(call, inputs))
    for x, out in zip(inputs, outputs):
        assert relative_error(torch.from_numpy(out), reference(x)) < 1e-5


def _bad_requests() -> list[tuple[str, dict, bytes, int, str]]:
    good = rand(1, 2, 512)
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    st = "application/x-safetensors"
    return [
        ("wrong embed dim", {"content-type": "application/x-npy"}, npy_bytes(rand(1, 2, 511)), 422, "invalid_input"),
        ("4-D input", {"content-type": "application/x-npy"}, npy_bytes(rand(1, 1, 2, 512)), 422, "invalid_input"),
        ("integer dtype", {"content-type": "application/x-npy"}, npy_bytes(np.ones((1, 2, 512), np.int64)), 422, "invalid_input"),
        ("NaN", {"content-type": "application/x-npy"}, npy_bytes(np.full((1, 2, 512), np.nan, np.float32)), 422, "invalid_input"),
        ("pickled npy", {"content-type": "application/x-npy"}, pickled.getvalue(), 422, "invalid_input"),
        ("garbage npy", {"content-type": "application/x-npy"}, b"not an npy file", 400, "malformed"),
        ("malformed JSON", {"content-type": "application/json"}, b'{"hidden_states": [[1,', 400, "malformed"),
        ("ragged JSON", {"content-type": "application/json"}, b'{"hidden_states": [[1.0], [1.0, 2.0]]}', 422, "invalid_input"),
        ("strings in JSON", {"content-type": "application/json"}, b'{"hidden_states": [["a"]]}', 422, "invalid_input"),
        ("JSON without hidden_states", {"content-type": "application/json"}, b'{"x": 1}', 422, "invalid_input"),
        ("wrong safetensors name", {"content-type": st}, st_save({"x": good}), 422, "invalid_input"),
        ("lying safetensors header", {"content-type": st}, (10**9).to_bytes(8, "little") + b"{}", 400, "malformed"),
        ("truncated safetensors", {"content-type": st}, st_save({"hidden_states": good})[:-100], 400, "malformed"),
        ("empty body", {"content-type": st}, b"", 400, "malformed"),
        ("unsupported media type", {"content-type": "text/plain"}, b"1,2,3", 415, "unsupported_media_type"),
        ("no media type", {}, npy_bytes(good), 415, "unsupported_media_type"),
        ("overlong sequence", {"content-type": "application/x-npy"}, npy_bytes(np.zeros((1, 4097, 512), np.float32)), 422, "invalid_input"),
    ]


@pytest.mark.parametrize("case", _bad_requests(), ids=lambda c: c[0])
def test_bad_request_gets_json_4xx_and_service_stays_healthy(app_url: str, case: tuple) -> None:
    _, headers, body, status, code = case
    assert_error(httpx.post(app_url + "/infer", content=body, headers=headers, timeout=60), status, code)
    x = rand(1, 3, 512, seed=9)
    r = httpx.post(app_url + "/infer", content=npy_bytes(x), headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200
    assert relative_error(torch.from_numpy(np.load(io.BytesIO(r.content))), reference(x)) < 1e-5


def test_oversize_body_is_refused_before_it_is_read(app_url: str) -> None:
    limit = 64 * 1024 * 1024
    r = httpx.post(app_url + "/infer", content=b"\0" * (limit + 1),
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert_error(r, 413, "body_too_large")
    assert str(limit) in r.json()["error"]


def test_unknown_route_is_json_404(app_url: str) -> None:
    assert_error(httpx.get(app_url + "/nope"), 404, "not_found")


def test_cli_infer_round_trip(app_url: str, tmp_path: Path) -> None:
    x = rand(2, 3, 512, seed=11)
    np.save(tmp_path / "in.npy", x)
    for out_name in ("out.npy", "out.safetensors"):
        proc = subprocess.run(
            [sys.executable, "-m", "gangserve_client", "--url", app_url, "infer", str(tmp_path / "in.npy"),
             "-o", str(tmp_path / out_name)],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr
        assert "output shape [2, 3, 512]" in proc.stdout
    out_npy = np.load(tmp_path / "out.npy")
    out_st = st_load((tmp_path / "out.safetensors").read_bytes())["output"]
    for out in (out_npy, out_st):
        assert relative_error(torch.from_numpy(out), reference(x)) < 1e-5


def test_world_size_4_from_a_checkpoint_serves_the_same_function(serve_url: str, tmp_path: Path) -> None:
    """World size 4 from a dense checkpoint, by value (no shared memory, no data channel),
    serves what the dense reference computes; then shutdown frees every rank. (World size 1
    and random init are served by the world-size apps of tests/shared_apps.py.)"""
    from ray import serve

    from service.parallel.weights import random_weights, save_checkpoint

    weights = random_weights(512, seed=3)
    path = tmp_path / "w.safetensors"
    save_checkpoint(path, weights, num_heads=8)
    # The by-value handle path, side by side with the defaults (shm, data channel).
    args = {**local_yaml_args(), "world_size": 4, "cpus_per_rank": 0.25, "checkpoint": str(path),
            "shm_transport": False, "data_channel": False}
    base = deploy(serve_url, "ws4", "/ws4", args)
    try:
        info = httpx.get(base + "/gang", timeout=30).json()
        assert info["world_size"] == 4 and len({r["pid"] for r in info["ranks"]}) == 4
        with GangServeClient(base) as client:
            x = rand(2, 6, 512, seed=4)
            out = client.infer(x, fmt="npy")
            assert relative_error(torch.from_numpy(out), reference(x, weights=weights)) < 1e-5
            big = rand(4, 16, 512, seed=5)  # 128 KiB: would qualify for shared memory
            out = client.infer(big, fmt="npy")
            assert relative_error(torch.from_numpy(out), reference(big, weights=weights)) < 1e-5
        transport = httpx.get(base + "/gang", timeout=30).json()["ingress_transport"]
        assert transport["shm_enabled"] is False and transport["shared_memory"] == 0
        assert transport["object_store"] >= 2, transport
    finally:
        serve.delete("ws4")
    # Graceful shutdown: every rank process is gone.
    pids = [r["pid"] for r in info["ranks"]]
    eventually(lambda: not any(pid_alive(p) for p in pids), 60, f"rank processes {pids} gone after serve.delete")


def test_weights_hot_swap_between_requests(serve_url: str, tmp_path: Path) -> None:
    """GangServer.reload_weights swaps every rank's slice; a mismatched checkpoint is refused."""
    from ray import serve

    from service.contract.errors import Conflict
    from service.parallel.weights import random_weights, save_checkpoint

    base = deploy(serve_url, "swap", "/swap", {**local_yaml_args(), "cpus_per_rank": 0.25})
    try:
        handle = serve.get_deployment_handle("GangServer", app_name="swap")
        x = rand(1, 4, 512, seed=21)
        with GangServeClient(base) as client:
            assert relative_error(torch.from_numpy(client.infer(x)), reference(x)) < 1e-5
            weights = random_weights(512, seed=8)
            good = tmp_path / "good.safetensors"
            save_checkpoint(good, weights, num_heads=8)
            info = handle.reload_weights.remote(str(good)).result(timeout_s=120)
            assert info.weights_version == 2 and info.weights_source == "swap"
            assert info.weights_description == "checkpoint good.safetensors" and str(tmp_path) not in str(info)
            assert relative_error(torch.from_numpy(client.infer(x)), reference(x, weights=weights)) < 1e-5
            bad = tmp_path / "bad.safetensors"
            save_checkpoint(bad, random_weights(64, seed=1), num_heads=8)
            with pytest.raises(Conflict, match="embed_dim=64, the model needs 512"):
                handle.reload_weights.remote(str(bad)).result(timeout_s=120)
            # Refused swap leaves the served weights and version untouched.
            assert client.gang()["weights_version"] == 2
            assert relative_error(torch.from_numpy(client.infer(x)), reference(x, weights=weights)) < 1e-5
    finally:
        undeploy("swap")


def test_concurrent_requests_of_equal_length_are_batched_and_split_exactly(app_url: str) -> None:
    """One batcher on the path: every request reaches the gang server on its own, and the
    gang's batcher coalesces concurrent ones into steps. Every reply must still be its own rows."""

    def counters() -> dict:
        info = httpx.get(app_url + "/gang", timeout=30).json()
        assert "batching" not in info["ingress_transport"], info["ingress_transport"]  # no second batcher
        return info["batching"]

    before = counters()
    inputs = [rand(1 + i % 3, 8, 512, seed=200 + i) for i in range(24)]
    bodies = [npy_bytes(x) for x in inputs]
    # Every thread is started and its body encoded before any sends: started one by one as the
    # pool took them, the requests reached a fast gang one after the other and none coalesced.
    start = threading.Barrier(len(inputs))

    def call(body: bytes) -> np.ndarray:
        start.wait(timeout=60)
        r = httpx.post(app_url + "/infer", content=body, headers={"content-type": "application/x-npy"}, timeout=120)
        assert r.status_code == 200, r.text
        return np.load(io.BytesIO(r.content), allow_pickle=False)

    with ThreadPoolExecutor(len(inputs)) as pool:  # one thread each: all wait at the barrier
        outputs = list(pool.map(call, bodies))
    for x, out in zip(inputs, outputs):
        assert out.shape == x.shape
        assert relative_error(torch.from_numpy(out), reference(x)) < 1e-5
    after = counters()
    requests = after["requests"] - before["requests"]
    steps = after["steps"] - before["steps"]
    assert requests == 24, (before, after)
    assert 1 <= steps < requests, f"24 concurrent requests took {steps} gang steps: the gang did not batch"
