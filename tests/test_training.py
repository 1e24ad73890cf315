"""Training jobs end to end: real Ray Train runs (small sizes), real Serve, real HTTP.

The long-running jobs are submitted together by one module fixture so they overlap on
this 2-core machine; each test then waits for, and checks, its own job. Expected outputs
come from tests.reference (torch.nn.MultiheadAttention), never from service code.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import save as st_save
from safetensors.torch import load as st_load_torch

from tests.conftest import ROOT, TEST_API_TOKEN
from tests.helpers import AUTH, SMALL, assert_error, get_job, post, state_dir, wait_done, wait_for
from tests.reference import dense_attention, notes_seed_weights, relative_error


# Job specs submitted together at module start (see `jobs`).
SPECS: dict[str, dict[str, Any]] = {
    # Small attention model: loss must fall; its checkpoint is checked with the reference.
    "attention": {**SMALL, "model": {"kind": "attention", "embed_dim": 64, "num_heads": 4},
                  "dataset": {"samples": 256, "seq_len": 4, "seed": 1}, "epochs": 4, "lr": 0.05},
    # The original notes' DDP example: Linear(10, 1), 1000 samples, batch 32, SGD 0.01, MSE, 5 epochs.
    "linear": {**SMALL, "model": {"kind": "linear", "in_features": 10, "out_features": 1},
               "dataset": {"samples": 1000}, "epochs": 5, "batch_size": 32, "lr": 0.01, "optimizer": "sgd"},
    # The serving shape (E=512, H=8), trained briefly, for POST /weights.
    "serve": {**SMALL, "dataset": {"samples": 64, "seq_len": 4, "seed": 2}, "epochs": 1, "optimizer": "adam",
              "lr": 0.001},
    # Long enough to kill a worker after its first checkpoint.
    "kill": {**SMALL, "model": {"kind": "linear"}, "dataset": {"samples": 4000}, "epochs": 20,
             "max_failures": 1},
}


@pytest.fixture(scope="module")
def jobs(app_url: str) -> dict[str, str]:
    """Submit every long job at once; name -> job id."""
    ids = {}
    for name, spec in SPECS.items():
        reply = post(app_url, "/train", spec)
        assert reply.status_code == 202, reply.text
        job = reply.json()
        assert reply.headers["location"] == f"/train/{job['id']}"
        assert job["status"] == "PENDING" and job["spec"]["epochs"] == spec["epochs"]
        ids[name] = job["id"]
    return ids


# ---- units (no Ray) ------------------------------------------------------------------------

@pytest.mark.unit
def test_empty_spec_is_a_small_valid_job() -> None:
    from service.training.spec import JobSpec

    spec = JobSpec.model_validate({})
    assert spec.model.kind == "attention" and spec.model.embed_dim == 512 and spec.model.num_heads == 8
    assert spec.dataset.kind == "synthetic" and spec.world_size == 2 and spec.epochs == 5
    assert (spec.batch_size, spec.lr, spec.optimizer, spec.max_failures) == (32, 0.01, "sgd", 1)
    assert spec.worker_bundle() == {"CPU": 0.5}
    assert JobSpec.model_validate({"use_gpu": True}).worker_bundle() == {"CPU": 0.5, "GPU": 1.0}


@pytest.mark.unit
def test_store_pages_newest_first_and_terminal_states_stick(store_url: str) -> None:
    """On SQLite and PostgreSQL (store_url): the store's contract."""
    from service.training.store import JobRecord, JobStore

    store = JobStore(store_url)
    for i in range(5):
        store.create_job(JobRecord(id=f"job-{i}", status="PENDING", spec={}, created_at=i, updated_at=i,
                                   progress={"epoch": 0, "epochs": 1, "step": 0}, owner="mgr-a"))
    page, nxt = store.list_jobs(2)
    assert [r.id for r in page] == ["job-4", "job-3"] and nxt is not None
    page, nxt = store.list_jobs(2, nxt)
    assert [r.id for r in page] == ["job-2", "job-1"]
    page, nxt = store.list_jobs(2, nxt)
    assert [r.id for r in page] == ["job-0"] and nxt is None
    assert store.update_job("job-0", status="CANCELLED")
    assert not store.update_job("job-0", status="RUNNING")  # a late update cannot undo a cancel
    assert store.get_job("job-0").status == "CANCELLED"
    store.append_logs("job-1", [(1, 1.0, "a"), (2, 2.0, "b"), (None, 3.0, "manager line")])
    store.append_logs("job-1", [(2, 2.0, "b"), (3, 4.0, "c")])  # re-polled line 2 is not duplicated
    assert [line for _, line in store.tail_logs("job-1", 10)] == ["a", "b", "manager line", "c"]
    assert store.last_run_log_seq("job-1") == 3
    store.close()
    reopened = JobStore(store_url)  # a restart keeps everything
    assert [r.id for r in reopened.list_jobs(10)[0]] == ["job-4", "job-3", "job-2", "job-1", "job-0"]
    # Only jobs whose owner stopped heartbeating are adopted, and only once.
    reopened.heartbeat("mgr-b")
    assert {r.id for r in reopened.adopt_orphans("mgr-b", stale_after_s=15)} == {"job-1", "job-2", "job-3", "job-4"}
    assert reopened.adopt_orphans("mgr-c", stale_after_s=15) == []
    reopened.close()


@pytest.mark.unit
def test_token_file_is_created_once_with_mode_0600(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.ingress.auth import load_api_token, token_matches

    monkeypatch.delenv("GANGSERVE_API_TOKEN", raising=False)
    token, where = load_api_token(tmp_path)
    assert where == str(tmp_path / "api_token") and len(token) >= 32
    assert (tmp_path / "api_token").stat().st_mode & 0o777 == 0o600
    assert load_api_token(tmp_path)[0] == token  # read back, not regenerated
    assert token_matches(token, token) and not token_matches(token[:-1], token)
    monkeypatch.setenv("GANGSERVE_API_TOKEN", "from-env")
    assert load_api_token(tmp_path) == ("from-env", "environment variable GANGSERVE_API_TOKEN")


@pytest.mark.unit
def test_paths_must_resolve_inside_the_state_dir(tmp_path: Path) -> None:
    from service.state.paths import resolve_inside

    (tmp_path / "checkpoints").mkdir()
    assert resolve_inside(tmp_path, "checkpoints/a.safetensors") == tmp_path / "checkpoints" / "a.safetensors"
    assert resolve_inside(tmp_path, str(tmp_path / "x")) == tmp_path / "x"
    (tmp_path / "checkpoints" / "out").symlink_to("/etc")
    for bad in ("../x", "/etc/passwd", "checkpoints/../../x", "checkpoints/out/hostname"):
        with pytest.raises(ValueError, match="outside the state dir"):
            resolve_inside(tmp_path, bad)


@pytest.mark.unit
def test_feasibility_counts_whole_bundles_per_node() -> None:
    from service.training.resources import infeasible_reason

    nodes = [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    assert infeasible_reason({"CPU": 0.5}, 12, nodes) is None
    assert infeasible_reason({"CPU": 1.0, "GPU": 1.0}, 2, nodes) is None
    why = infeasible_reason({"CPU": 0.5, "GPU": 1.0}, 8, nodes)
    assert why and "8 worker(s) x {CPU: 0.5, GPU: 1} = {CPU: 4, GPU: 8}" in why and "{CPU: 6, GPU: 2}" in why
    assert "room for at most 2" in why
    assert "room for at most 1" in (infeasible_reason({"CPU": 3.0}, 2, nodes) or "")


# ---- admission: auth, schema, fail-fast ---------------------------------------------------

@pytest.mark.ray
@pytest.mark.slow
def test_mutating_routes_need_the_token(app_url: str) -> None:
    bad = {"authorization": "Bearer not-the-token"}
    for path, body in (("/train", {}), ("/train/job-000000000000/cancel", None), ("/weights", {"job_id": "x"}),
                       ("/datasets", None)):
        assert_error(httpx.post(app_url + path, json=body, timeout=30), 401, "missing_token")
        assert_error(httpx.post(app_url + path, json=body, headers=bad, timeout=30), 401, "invalid_token")
    assert_error(httpx.get(app_url + "/datasets", timeout=30), 401, "missing_token")
    assert_error(httpx.post(app_url + "/train", json={}, headers={"authorization": "Basic abc"}, timeout=30),
                 401, "missing_token")


@pytest.mark.parametrize("body, where", [
    ({"epochz": 3}, "epochz"),
    ({"epochs": 0}, "epochs"),
    ({"epochs": 10**9}, "epochs"),
    ({"lr": -1}, "lr"),
    ({"world_size": 0}, "world_size"),
    ({"optimizer": "rmsprop"}, "optimizer"),
    ({"model": {"kind": "conv"}}, "model"),
    ({"model": {"kind": "attention", "embed_dim": 100, "num_heads": 3}}, "divisible"),
    ({"model": {"kind": "linear", "hidden": 4}}, "hidden"),
    ({"dataset": {"kind": "synthetic", "samples": 10**6, "seq_len": 4096}}, "too large"),
    ({"dataset": {"kind": "uploaded", "id": "../../etc"}}, "dataset"),
    ({"dataset": {"kind": "uploaded", "id": "ds-000000000000"}}, "does not exist"),
])
@pytest.mark.ray
@pytest.mark.slow
def test_schema_rejections(app_url: str, body: dict[str, Any], where: str) -> None:
    doc = assert_error(post(app_url, "/train", body), 422)
    assert where in doc["error"], doc


@pytest.mark.ray
@pytest.mark.slow
def test_malformed_bodies(app_url: str) -> None:
    assert_error(httpx.post(app_url + "/train", content=b"{not json", headers=AUTH, timeout=30), 400, "malformed")
    assert_error(httpx.post(app_url + "/train", content=b"[1, 2]", headers=AUTH, timeout=30), 400, "malformed")


@pytest.mark.ray
@pytest.mark.slow
def test_infeasible_job_fails_fast_with_numbers(app_url: str) -> None:
    """8 GPU workers on a cluster with 2 (logical) GPUs: 422 at once, needed vs available."""
    t0 = time.monotonic()
    doc = assert_error(post(app_url, "/train", {"world_size": 8, "use_gpu": True}), 422, "infeasible")
    assert time.monotonic() - t0 < 10
    assert "8 worker(s)" in doc["error"] and "GPU: 8" in doc["error"] and "GPU: 2" in doc["error"], doc
    # Each worker's bundle must fit on ONE node: 2 x 3 CPUs on nodes of 4 and 2 CPUs cannot.
    doc = assert_error(post(app_url, "/train", {"world_size": 2, "cpus_per_worker": 3}), 422, "infeasible")
    assert "room for at most 1" in doc["error"], doc
    # Nothing was recorded for refused jobs.
    listed = httpx.get(app_url + "/train", params={"limit": 200}, headers=AUTH, timeout=30).json()["jobs"]
    assert not any(j["spec"]["world_size"] == 8 for j in listed)


# ---- jobs run to completion ---------------------------------------------------------------

@pytest.mark.ray
@pytest.mark.slow
def test_attention_job_learns_and_its_checkpoint_is_the_dense_model(app_url: str, jobs: dict[str, str]) -> None:
    job_id = jobs["attention"]
    job = wait_done(app_url, job_id)
    assert job["status"] == "SUCCEEDED", job
    losses = [h["loss"] for h in job["history"]]
    assert [h["epoch"] for h in job["history"]] == [1, 2, 3, 4]
    assert losses[-1] < 0.8 * losses[0], losses
    assert job["progress"]["epoch"] == job["progress"]["epochs"] == 4 and job["progress"]["step"] > 0
    assert job["error"] is None and job["checkpoint"]["url"] == f"/train/{job_id}/checkpoint"
    assert job["created_at"] <= job["started_at"] <= job["finished_at"]

    reply = httpx.get(f"{app_url}/train/{job_id}/checkpoint", headers=AUTH, timeout=60)
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/x-safetensors"
    weights = st_load_torch(reply.content)
    assert sorted(weights) == sorted(f"{p}.{k}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")
                                     for k in ("weight", "bias"))
    assert all(weights[k].shape == ((64, 64) if k.endswith("weight") else (64,)) for k in weights)
    from safetensors import safe_open
    path = state_dir() / "checkpoints" / f"{job_id}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"embed_dim": "64", "num_heads": "4", "causal": "false"}

    # The independent reference, holding the checkpoint, fits the synthetic data far better
    # than the untrained student did: the keys map onto the trained module correctly.
    from service.training.datasets import synthetic
    from service.training.models import build_model, dense_weights
    from service.training.spec import JobSpec

    spec = JobSpec.model_validate(job["spec"])
    x, y = synthetic(spec.model, spec.dataset)
    untrained = dense_weights(build_model(spec.model, spec.seed))

    def loss_of(w: dict[str, torch.Tensor]) -> float:
        return float((dense_attention(w, 4, x) - y).pow(2).sum(-1).mean())

    assert loss_of(weights) < 0.8 * loss_of(untrained)


@pytest.mark.ray
@pytest.mark.slow
def test_linear_seed_example_trains(app_url: str, jobs: dict[str, str]) -> None:
    job = wait_done(app_url, jobs["linear"])
    assert job["status"] == "SUCCEEDED", job
    losses = [h["loss"] for h in job["history"]]
    assert len(losses) == 5 and losses[-1] < 0.5 * losses[0], losses
    # 1000 samples over 2 ranks with batch 32: 16 steps per rank per epoch.
    assert job["progress"]["step"] == 5 * 16
    assert job["checkpoint"]["format"] == "linear"
    logs = httpx.get(f"{app_url}/train/{job['id']}/logs", headers=AUTH, timeout=30).json()["lines"]
    assert any("epoch 5/5" in line for line in logs), logs
    # A linear checkpoint cannot be served by the attention gang.
    assert_error(post(app_url, "/weights", {"job_id": job["id"]}), 409, "checkpoint_mismatch")


@pytest.mark.ray
@pytest.mark.slow
def test_worker_killed_mid_run_resumes_from_checkpoint(app_url: str, jobs: dict[str, str]) -> None:
    job_id = jobs["kill"]
    # Epoch e's history entry is written once rank 0's report (with its checkpoint) returned,
    # but Ray Train's controller registers that checkpoint asynchronously: a worker group
    # killed right then restarts from scratch. Three epochs in, the first is registered.
    job = wait_for(app_url, job_id, lambda j: j["status"] == "RUNNING" and len(j["history"]) >= 3
                   and len(j["workers"]) == 2, 240, "reached epoch 3")
    victim = next(w for w in job["workers"] if w["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    done = wait_done(app_url, job_id)
    assert done["status"] == "SUCCEEDED", done
    assert done["attempts"] == 2, done
    assert [h["epoch"] for h in done["history"]] == list(range(1, SPECS["kill"]["epochs"] + 1))
    assert all(w["attempt"] == 2 for w in done["workers"]) and victim["pid"] not in [w["pid"] for w in done["workers"]]
    logs = httpx.get(f"{app_url}/train/{job_id}/logs", params={"tail": 2000}, headers=AUTH, timeout=30).json()["lines"]
    assert any("attempt 2" in line and "resuming from the checkpoint after epoch" in line for line in logs), logs


@pytest.mark.ray
@pytest.mark.slow
def test_cancel_stops_the_run_and_frees_its_workers(app_url: str) -> None:
    reply = post(app_url, "/train", {**SMALL, "model": {"kind": "linear"}, "dataset": {"samples": 4000},
                                     "epochs": 10_000})
    assert reply.status_code == 202, reply.text
    job_id = reply.json()["id"]
    job = wait_for(app_url, job_id, lambda j: j["status"] == "RUNNING" and len(j["workers"]) == 2, 240, "ran")
    t0 = time.monotonic()
    reply = post(app_url, f"/train/{job_id}/cancel")
    assert reply.status_code == 200, reply.text
    assert reply.json()["status"] == "CANCELLED"
    pids = [w["pid"] for w in job["workers"]]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), f"workers {pids} still alive {time.monotonic() - t0:.1f}s after cancel"
    time.sleep(2)
    assert get_job(app_url, job_id)["status"] == "CANCELLED"  # no late update overrides it
    assert_error(post(app_url, f"/train/{job_id}/cancel"), 409, "job_finished")
    assert_error(post(app_url, "/train/job-doesnotexist/cancel"), 404, "job_not_found")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# ---- datasets and the CLI ------------------------------------------------------------------

@pytest.mark.ray
@pytest.mark.slow
def test_dataset_upload_validation(app_url: str) -> None:
    def upload(body: bytes) -> httpx.Response:
        return httpx.post(app_url + "/datasets", content=body, timeout=30,
                          headers={**AUTH, "content-type": "application/x-safetensors"})

    x = np.zeros((8, 10), np.float32)
    assert_error(upload(b"definitely not safetensors"), 400, "malformed")
    assert_error(upload(st_save({"inputs": x, "labels": x[:, :1]})), 422, "invalid_dataset")
    assert_error(upload(st_save({"inputs": x, "targets": x[:4, :1]})), 422, "invalid_dataset")
    assert_error(upload(st_save({"inputs": x.astype(np.int32), "targets": x[:, :1]})), 422, "invalid_dataset")
    nan = x.copy()
    nan[0, 0] = np.nan
    assert_error(upload(st_save({"inputs": nan, "targets": x[:, :1]})), 422, "invalid_dataset")
    ok = upload(st_save({"inputs": x, "targets": x[:, :2]}))
    assert ok.status_code == 201, ok.text
    # Its shapes do not fit the default Linear(10, 1): refused at submit.
    doc = assert_error(post(app_url, "/train", {"model": {"kind": "linear"},
                                                "dataset": {"kind": "uploaded", "id": ok.json()["id"]}}), 422)
    assert "[N, 1]" in doc["error"] and "[8, 2]" in doc["error"], doc


@pytest.mark.ray
@pytest.mark.slow
def test_cli_trains_on_an_uploaded_dataset(app_url: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 10), dtype=np.float32)
    y = (x @ rng.standard_normal((10, 1), dtype=np.float32) + 0.5).astype(np.float32)
    reply = httpx.post(app_url + "/datasets", content=st_save({"inputs": x, "targets": y}), timeout=30,
                       headers={**AUTH, "content-type": "application/x-safetensors"})
    assert reply.status_code == 201, reply.text
    ds = reply.json()
    assert ds["kind"] == "linear" and ds["samples"] == 256 and ds["inputs_shape"] == [256, 10]
    listed = httpx.get(app_url + "/datasets", headers=AUTH, timeout=30).json()["datasets"]
    assert ds["id"] in [d["id"] for d in listed]

    env = {**os.environ, "GANGSERVE_API_TOKEN": TEST_API_TOKEN}
    cmd = [sys.executable, "-m", "gangserve_client", "--url", app_url]
    run = subprocess.run(cmd + ["train", "--model", "linear", "--dataset", ds["id"], "--epochs", "3",
                                "--cpus-per-worker", "0.25", "--follow", "--timeout", "300"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["status"] == "SUCCEEDED" and len(result["losses"]) == 3
    assert "3/3 epochs" in run.stderr and "loss" in run.stderr
    listing = subprocess.run(cmd + ["jobs"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and result["id"] in listing.stdout
    refused = subprocess.run(cmd + ["train", "--world-size", "8", "--gpu", "--follow"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "infeasible" in refused.stderr
    no_token = subprocess.run(cmd + ["train"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in env.items() if k not in ("GANGSERVE_API_TOKEN", "GANGSERVE_STATE_DIR")})
    assert no_token.returncode == 1 and "401" in no_token.stderr


# ---- train -> serve -----------------------------------------------------------------------

@pytest.mark.ray
@pytest.mark.slow
def test_weights_hot_swap_under_traffic(app_url: str, jobs: dict[str, str]) -> None:
    job = wait_done(app_url, jobs["serve"])
    assert job["status"] == "SUCCEEDED", job
    trained = st_load_torch(httpx.get(f"{app_url}/train/{job['id']}/checkpoint", headers=AUTH, timeout=60).content)
    before = httpx.get(app_url + "/gang", timeout=30).json()["weights_version"]
    x = np.random.default_rng(7).standard_normal((2, 4, 512), dtype=np.float32)

    def infer() -> np.ndarray:
        reply = httpx.post(app_url + "/infer", json={"hidden_states": x.tolist()}, timeout=120)
        assert reply.status_code == 200, reply.text
        return np.asarray(reply.json()["output"], dtype=np.float32)

    stop = threading.Event()
    failures: list[str] = []
    counts = [0]

    def traffic() -> None:
        while not stop.is_set():
            try:
                infer()
                counts[0] += 1
            except AssertionError as exc:
                failures.append(str(exc))

    restore = state_dir() / "checkpoints" / "seed-weights-restore.safetensors"
    from service.parallel.weights import save_checkpoint
    save_checkpoint(restore, notes_seed_weights(512), 8)
    try:
        with ThreadPoolExecutor(4) as pool:
            for _ in range(4):
                pool.submit(traffic)
            time.sleep(1)
            reply = post(app_url, "/weights", {"job_id": job["id"]}, timeout=330)
            time.sleep(1)
            stop.set()
        assert reply.status_code == 200, reply.text
        assert not failures, failures[:3]
        assert counts[0] > 4
        assert reply.json()["weights_version"] > before
        assert httpx.get(app_url + "/gang", timeout=30).json()["weights_version"] == reply.json()["weights_version"]
        got = torch.from_numpy(infer())
        assert relative_error(got, dense_attention(trained, 8, torch.from_numpy(x))) < 1e-5
    finally:
        # Put the notes' seed weights back for the rest of the session (a path in the state dir).
        back = post(app_url, "/weights", {"checkpoint": "checkpoints/seed-weights-restore.safetensors"}, timeout=330)
        assert back.status_code == 200, back.text
    seed_out = torch.from_numpy(infer())
    assert relative_error(seed_out, dense_attention(notes_seed_weights(512), 8, torch.from_numpy(x))) < 1e-5


@pytest.mark.ray
@pytest.mark.slow
def test_weights_refuses_paths_outside_the_state_dir(app_url: str, jobs: dict[str, str]) -> None:
    for path in ("../../../etc/passwd", "/etc/passwd", "checkpoints/../../outside.safetensors"):
        assert_error(post(app_url, "/weights", {"checkpoint": path}), 422, "path_outside_state_dir")
    link = state_dir() / "checkpoints" / "escape.safetensors"
    link.unlink(missing_ok=True)
    link.symlink_to("/etc/hostname")
    assert_error(post(app_url, "/weights", {"checkpoint": "checkpoints/escape.safetensors"}), 422,
                 "path_outside_state_dir")
    assert_error(post(app_url, "/weights", {"checkpoint": "checkpoints/missing.safetensors"}), 404)
    assert_error(post(app_url, "/weights", {"job_id": "job-doesnotexist"}), 404, "job_not_found")
    assert_error(post(app_url, "/weights", {}), 422)
    assert_error(post(app_url, "/weights", {"job_id": jobs["kill"], "path": "x"}), 422)


# ---- records survive -----------------------------------------------------------------------

@pytest.mark.ray
@pytest.mark.slow
def test_list_is_newest_first_and_paginated(app_url: str, jobs: dict[str, str]) -> None:
    seen: list[dict[str, Any]] = []
    cursor = None
    for _ in range(50):
        params: dict[str, Any] = {"limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = httpx.get(app_url + "/train", params=params, headers=AUTH, timeout=30).json()
        assert set(page) == {"jobs", "next"} and len(page["jobs"]) <= 2
        seen.extend(page["jobs"])
        cursor = page["next"]
        if cursor is None:
            break
    ids = [j["id"] for j in seen]
    assert len(ids) == len(set(ids)) and set(jobs.values()) <= set(ids)
    created = [j["created_at"] for j in seen]
    assert created == sorted(created, reverse=True)
    for j in seen:
        assert {"id", "status", "spec", "created_at", "updated_at", "progress", "history", "error",
                "checkpoint"} <= set(j)
        assert {"epoch", "epochs", "step"} <= set(j["progress"])
    assert_error(httpx.get(app_url + "/train", params={"cursor": "abc"}, headers=AUTH, timeout=30), 422)
    assert_error(httpx.get(app_url + "/train/job-doesnotexist", headers=AUTH, timeout=30), 404, "job_not_found")


@pytest.mark.ray
@pytest.mark.slow
def test_restart_keeps_every_record_and_settles_orphans(app_url: str, jobs: dict[str, str]) -> None:
    """A second JobManager on the same state dir sees every job; a job left RUNNING by a
    manager that died becomes FAILED 'service restarted' (its run is gone)."""
    from ray import serve

    from service.deployments.job_manager import JobManager
    from service.training.store import JobRecord, JobStore

    for job_id in jobs.values():
        wait_done(app_url, job_id)
    store = JobStore(state_dir() / "jobs.sqlite")
    now = time.time()
    store.create_job(JobRecord(id="job-orphan00000", status="RUNNING", spec={"epochs": 3}, created_at=now,
                               updated_at=now, progress={"epoch": 1, "epochs": 3, "step": 5},
                               history=[{"epoch": 1, "loss": 1.0}], owner="mgr-dead"))
    store.close()

    handle = serve.run(JobManager.bind(), name="jobs-restart", route_prefix=None)
    try:
        listed = handle.list_jobs.remote(200).result(timeout_s=60)["jobs"]
        by_id = {j["id"]: j for j in listed}
        for job_id in jobs.values():
            assert by_id[job_id] == get_job(app_url, job_id)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            orphan = handle.get_job.remote("job-orphan00000").result(timeout_s=30)
            if orphan["status"] != "RUNNING":
                break
            time.sleep(0.5)
        assert orphan["status"] == "FAILED" and "service restarted" in orphan["error"], orphan
        assert orphan["history"] == [{"epoch": 1, "loss": 1.0}]
    finally:
        serve.delete("jobs-restart")
