"""Served weights are durable state: swaps survive replica loss and restarts, and are atomic.

Real Ray, Serve and HTTP; faults are real (kill -9 of rank 0's process, a truncated file)
or one-shot failpoints armed on one rank (service.gang.failpoints). Every answer is compared
with torch.nn.MultiheadAttention holding the weights it must have come from.
"""
from __future__ import annotations

import hashlib
import io
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import TEST_API_TOKEN, deploy, local_yaml_args, undeploy
from tests.faults import RequestLoop, gang_info, wait_for_new_gang
from tests.helpers import eventually, scrape, total
from tests.reference import dense_attention, relative_error

pytestmark = [pytest.mark.ray, pytest.mark.slow]

AUTH = {"authorization": f"Bearer {TEST_API_TOKEN}"}
APP = "durable"


def _weights(seed: int, embed_dim: int = 512) -> dict[str, torch.Tensor]:
    """Independent test weights (not the service's init code), small enough for finite outputs."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return {f"{p}.{k}": torch.randn(*((embed_dim, embed_dim) if k == "weight" else (embed_dim,)), generator=gen) * 0.05
            for p in ("q_proj", "k_proj", "v_proj", "out_proj") for k in ("weight", "bias")}


def _write(name: str, weights: dict[str, torch.Tensor]) -> tuple[str, str]:
    """Save a dense checkpoint inside the state dir; returns (relative path, sha256)."""
    from service.state.paths import state_dir

    path = state_dir() / "checkpoints" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path), metadata={"embed_dim": "512", "num_heads": "8"})
    return f"checkpoints/{name}", hashlib.sha256(path.read_bytes()).hexdigest()


def _swap(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/weights", json=body, headers=AUTH, timeout=330)


def _answer(base: str, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    x = np.random.default_rng(seed).standard_normal((1, 5, 512), dtype=np.float32)
    buf = io.BytesIO()
    np.save(buf, x)
    r = httpx.post(base + "/infer", content=buf.getvalue(), headers={"content-type": "application/x-npy"}, timeout=120)
    assert r.status_code == 200, r.text
    return x, torch.from_numpy(np.load(io.BytesIO(r.content)))


def _assert_serves(base: str, weights: dict[str, torch.Tensor]) -> None:
    x, got = _answer(base)
    assert relative_error(got, dense_attention(weights, 8, torch.from_numpy(x))) < 1e-5


def _arm(rank: int, name: str, app: str = APP) -> None:
    from ray import serve

    serve.get_deployment_handle("GangServer", app_name=app).arm_failpoint.remote(rank, name).result(timeout_s=60)


def _wait_ready_version(base: str, version: int, timeout_s: float = 180) -> dict:
    def ready() -> dict | None:
        info = gang_info(base)
        return info if info and info.get("state") == "ready" and info.get("weights_version") == version else None

    return eventually(ready, timeout_s, f"the gang ready with weights version {version} (/gang)")


def _start_from(base: str, seed: int) -> dict[str, torch.Tensor]:
    """Make the app serve _weights(seed) (a swap, unless it already does: then nothing) and
    return them, so that each test starts from known weights whichever tests ran before."""
    weights = _weights(seed)
    rel, sha = _write(f"durable-start-{seed}.safetensors", weights)
    if gang_info(base)["weights_sha256"] != sha:
        reply = _swap(base, {"checkpoint": rel})
        assert reply.status_code == 200, reply.text
    _assert_serves(base, weights)
    return weights


def _args(seed: int) -> dict:
    return {**local_yaml_args(), "init": "random", "seed": seed, "cpus_per_rank": 0.25, "collective_timeout_s": 10.0}


@pytest.fixture(scope="module")
def durable_url(serve_url: str):
    base = deploy(serve_url, APP, "/durable", _args(3))
    yield base
    undeploy(APP)


def test_swap_survives_the_loss_of_rank_0(durable_url: str) -> None:
    base = durable_url
    weights = _weights(1)
    rel, sha = _write("durable-a.safetensors", weights)
    reply = _swap(base, {"checkpoint": rel})
    assert reply.status_code == 200, reply.text
    version = reply.json()["weights_version"]
    info = gang_info(base)
    assert (info["weights_version"], info["weights_source"], info["weights_sha256"]) == (version, "swap", sha)
    _assert_serves(base, weights)
    # The record points at its own immutable copy: the file it came from may go.
    from service.state.paths import state_dir

    (state_dir() / rel).unlink()

    rank0 = info["ranks"][0]["pid"]
    os.kill(rank0, signal.SIGKILL)  # the GangServer replica itself: Serve replaces it
    new, took = wait_for_new_gang(base, {r["pid"] for r in info["ranks"]}, timeout_s=240)
    print(f"replica replaced in {took:.1f}s")
    assert (new["weights_version"], new["weights_source"], new["weights_sha256"]) == (version, "swap", sha)
    _assert_serves(base, weights)


def test_unreadable_checkpoint_leaves_the_old_weights_everywhere(durable_url: str) -> None:
    base = durable_url
    current = _start_from(base, 1)
    before = gang_info(base)

    # A file whose data is cut short: refused, nothing changes.
    rel, _ = _write("durable-truncated.safetensors", _weights(2))
    from service.state.paths import state_dir

    path = state_dir() / rel
    path.write_bytes(path.read_bytes()[:-4096])
    reply = _swap(base, {"checkpoint": rel})
    assert reply.status_code == 409, reply.text
    assert reply.json()["code"] in ("checkpoint_mismatch", "weights_stage_failed"), reply.text

    # One rank cannot stage (a failpoint on rank 1 only): refused, rank 0 keeps the old weights too.
    rel, _ = _write("durable-b.safetensors", _weights(3))
    _arm(1, "stage_weights")
    reply = _swap(base, {"checkpoint": rel})
    assert reply.status_code == 409, reply.text
    body = reply.json()
    assert body["code"] == "weights_stage_failed" and "rank 1" in body["error"], body
    after = gang_info(base)
    assert after["weights_version"] == before["weights_version"] and after["state"] == "ready"
    assert after["weights_sha256"] == before["weights_sha256"]
    _assert_serves(base, current)


def test_commit_failure_rebuilds_with_the_recorded_version_never_mixed(durable_url: str) -> None:
    base = durable_url
    old, new = _start_from(base, 1), _weights(4)
    rel, sha = _write("durable-c.safetensors", new)
    before = gang_info(base)
    with RequestLoop(base + "/infer", old, alternatives=[new]) as loop:
        loop.wait_answered(2)  # both clients are sending before the swap
        _arm(1, "commit_weights")
        reply = _swap(base, {"checkpoint": rel})
        assert reply.status_code == 503, reply.text
        assert reply.json()["code"] == "weights_commit_failed", reply.text
        recorded = before["weights_version"] + 1
        assert f"version {recorded}" in reply.json()["error"]
        info = _wait_ready_version(base, recorded)
        loop.wait_answered(2, after=time.monotonic())  # the rebuilt gang answers the load
    summary = loop.summary()
    print("request loop:", summary)
    assert summary["wrong"] == 0, "an answer came from mixed or unknown weights"
    assert set(summary["statuses"]) <= {200, 503, 504}, summary
    assert info["weights_sha256"] == sha and info["generation"] > before["generation"]
    _assert_serves(base, new)


def test_a_rank_on_another_version_refuses_the_step(durable_url: str) -> None:
    """A commit that claims success but leaves rank 1 on its old weights: the next step is
    refused (weights_version_mismatch), never answered from mixed weights; the gang is
    rebuilt and the request, retried inside the service, is answered from the new weights."""
    base = durable_url
    old, new = _start_from(base, 4), _weights(5)
    rel, _ = _write("durable-d.safetensors", new)
    retries_before = total(scrape(base), "gangserve_request_retries_total", code="weights_version_mismatch")
    _arm(1, "commit_weights_noop")
    reply = _swap(base, {"checkpoint": rel})
    assert reply.status_code == 200, reply.text
    version = reply.json()["weights_version"]
    x = np.random.default_rng(9).standard_normal((1, 3, 512), dtype=np.float32)
    r = httpx.post(base + "/infer", json={"hidden_states": x.tolist()}, timeout=120)
    assert r.status_code == 200, r.text
    got = torch.tensor(r.json()["output"])
    assert relative_error(got, dense_attention(new, 8, torch.from_numpy(x))) < 1e-5
    assert relative_error(got, dense_attention(old, 8, torch.from_numpy(x))) > 1e-2
    retried = total(scrape(base), "gangserve_request_retries_total", code="weights_version_mismatch") - retries_before
    assert retried >= 1, "the mismatched step was not refused (no retry after weights_version_mismatch)"
    _wait_ready_version(base, version)


def test_concurrent_swaps_under_load_serialize_and_every_answer_is_one_version(durable_url: str) -> None:
    base = durable_url
    current, f, g = _start_from(base, 5), _weights(6), _weights(7)
    rel_f, sha_f = _write("durable-f.safetensors", f)
    rel_g, sha_g = _write("durable-g.safetensors", g)
    start = gang_info(base)["weights_version"]
    replies: dict[str, httpx.Response] = {}

    def swap(name: str, rel: str) -> None:
        replies[name] = _swap(base, {"checkpoint": rel})

    with RequestLoop(base + "/infer", current, alternatives=[f, g]) as loop:
        loop.wait_answered(2)  # both clients are sending before the swaps
        threads = [threading.Thread(target=swap, args=a) for a in (("f", rel_f), ("g", rel_g))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=330)
        loop.wait_answered(2, after=time.monotonic())  # and after them
    summary = loop.summary()
    print("request loop:", summary)
    assert summary["wrong"] == 0 and set(summary["statuses"]) == {200}, summary
    assert all(r.status_code == 200 for r in replies.values()), {k: r.text for k, r in replies.items()}
    versions = {k: r.json()["weights_version"] for k, r in replies.items()}
    assert sorted(versions.values()) == [start + 1, start + 2], versions
    last = max(versions, key=versions.get)
    info = gang_info(base)
    assert info["weights_version"] == start + 2 and info["weights_sha256"] == {"f": sha_f, "g": sha_g}[last]
    _assert_serves(base, {"f": f, "g": g}[last])


def test_reset_serves_the_config_weights_again(durable_url: str) -> None:
    from service.parallel.weights import random_weights

    base = durable_url
    start = gang_info(base)["weights_version"]
    reply = _swap(base, {"reset": True})
    assert reply.status_code == 200, reply.text
    info = gang_info(base)
    assert (info["weights_version"], info["weights_source"]) == (start + 1, "config")
    assert info["weights_description"] == "init=random seed=3"
    _assert_serves(base, random_weights(512, 3))
    assert _swap(base, {"reset": True, "job_id": "job-x"}).status_code == 422


def test_swap_survives_an_app_restart_and_a_changed_config_wins(durable_url: str, serve_url: str) -> None:
    """The module's app restarted (deleted, deployed again under its name on the same state
    dir): a swap survives a restart with the same config; a changed weights config then wins.
    Last in the module, on the module's app (one Serve app deploy fewer than an app of its
    own: 15-35 s here); it leaves that app on seed 12's config weights, and the fixture
    deletes it."""
    from ray import serve

    from service.parallel.weights import random_weights
    from service.weights.record import WeightsRecord
    from service.state.paths import state_dir

    base = durable_url
    weights = _weights(8)
    rel, sha = _write("restart-a.safetensors", weights)
    reply = _swap(base, {"checkpoint": rel})
    assert reply.status_code == 200, reply.text
    version = reply.json()["weights_version"]
    t0 = time.monotonic()
    serve.delete(APP)  # blocking: the same name is deployed again at once
    t1 = time.monotonic()
    assert deploy(serve_url, APP, "/durable", _args(3)) == base  # same config, same state dir
    t2 = time.monotonic()
    info = gang_info(base)
    assert (info["weights_version"], info["weights_source"], info["weights_sha256"]) == (version, "swap", sha)
    _assert_serves(base, weights)
    t3 = time.monotonic()
    serve.delete(APP)
    t4 = time.monotonic()
    assert deploy(serve_url, APP, "/durable", _args(12)) == base  # the operator changed the weights config
    print(f"app restart: delete {t1 - t0:.1f}s, deploy {t2 - t1:.1f}s; with a changed config: delete "
          f"{t4 - t3:.1f}s, deploy {time.monotonic() - t4:.1f}s")
    info = gang_info(base)
    assert (info["weights_version"], info["weights_source"]) == (version + 1, "config")
    _assert_serves(base, random_weights(512, 12))
    history = WeightsRecord(state_dir()).history(APP)
    assert [(w.version, w.source) for w in history][-2:] == [(version, "swap"), (version + 1, "config")]
    assert all(w.superseded_at is not None for w in history[:-1]) and history[-1].superseded_at is None
