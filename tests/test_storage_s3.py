"""The service end to end with its artifacts on object storage (GANGSERVE_STORAGE_URL=s3://...).

A real S3-compatible server on loopback (moto, tests/s3.py; its own server, because the
last test stops it), an app whose deployments get the storage settings as runtime_env
env_vars (their rank, run and training rank actor processes inherit them) and their own
state dir, which then holds only the node cache and the SQLite records. Through real
HTTP: upload a dataset, train on it (its run directory, the epoch checkpoints, in the bucket),
POST /weights {"job_id"}, and /infer against a dense torch.nn.MultiheadAttention holding
the checkpoint downloaded from the bucket independently with boto3. Then the server stops:
every route that needs the store answers 503 `storage_unavailable`, never 500 (and a
refused delete leaves its record), while inference keeps serving the weights already loaded.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import save as st_save
from safetensors.torch import load as st_load_torch

from tests.conftest import TEST_API_TOKEN, local_yaml_args, suite_args, undeploy, wait_ready
from tests.helpers import wait_done
from tests.reference import dense_attention, relative_error
from tests.s3 import MotoS3

pytestmark = [pytest.mark.ray, pytest.mark.slow]

AUTH = {"authorization": f"Bearer {TEST_API_TOKEN}"}
APP, PREFIX, BUCKET, ROOT = "s3store", "/s3", "gangserve-e2e", "svc"


def with_env(app: Any, env: dict[str, str], _done: dict[int, Any] | None = None) -> Any:
    """`app` with `env` added to every deployment's runtime_env env_vars (merged with what
    the builder set there, e.g. the same-event-loop switches). A deployment bound into
    several others (the Controller) stays one deployment: each is rewritten once."""
    from ray.serve import Application

    done = {} if _done is None else _done
    if id(app) in done:
        return done[id(app)]
    deployment = app._bound_deployment  # noqa: SLF001 - Serve has no public way to rewrite a bound graph
    args = tuple(with_env(a, env, done) if isinstance(a, Application) else a for a in deployment.init_args)
    options = dict(deployment.ray_actor_options or {})
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **env}
    options["runtime_env"] = runtime_env
    done[id(app)] = Application(deployment.options(ray_actor_options=options, _init_args=args))
    return done[id(app)]


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    server = MotoS3().start()
    server.bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3_app(serve_url: str, s3: MotoS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    from ray import serve

    from service.app import build_app

    state = tmp_path_factory.mktemp("s3-app-state")
    env = {**s3.env(f"s3://{BUCKET}/{ROOT}"), "GANGSERVE_STATE_DIR": str(state)}
    args = {**local_yaml_args(), "world_size": 2, "cpus_per_rank": 0.25}
    serve.run(with_env(build_app(suite_args(args)), env), name=APP, route_prefix=PREFIX, blocking=False)
    try:
        yield wait_ready(serve_url + PREFIX, 240, f"app {APP}"), state
    finally:
        undeploy(APP)


def _objects(s3: MotoS3, prefix: str) -> dict[str, int]:
    listed = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{ROOT}/{prefix}")
    return {o["Key"][len(ROOT) + 1:]: o["Size"] for o in listed.get("Contents", [])}


@pytest.fixture(scope="module")
def trained(s3_app: tuple[str, Path]) -> dict[str, Any]:
    """An uploaded dataset and a finished one-epoch job trained on it, through the app:
    {"dataset": id, "job": the job's record}. What both tests start from."""
    base, _ = s3_app
    x = np.random.default_rng(3).standard_normal((32, 4, 512), dtype=np.float32)
    body = st_save({"inputs": x, "targets": np.tanh(x)})
    reply = httpx.post(base + "/datasets", content=body, timeout=60,
                       headers={**AUTH, "content-type": "application/x-safetensors"})
    assert reply.status_code == 201, reply.text
    dataset = reply.json()["id"]
    spec = {"cpus_per_worker": 0.25, "dataset": {"kind": "uploaded", "id": dataset}, "epochs": 1,
            "optimizer": "adam", "lr": 0.001, "batch_size": 8}
    reply = httpx.post(base + "/train", json=spec, headers=AUTH, timeout=60)
    assert reply.status_code == 202, reply.text
    job = wait_done(base, reply.json()["id"], 420)
    assert job["status"] == "SUCCEEDED", job
    return {"dataset": dataset, "job": job}


def test_dataset_training_and_served_weights_live_in_the_bucket(
        s3_app: tuple[str, Path], s3: MotoS3, trained: dict[str, Any]) -> None:
    base, state = s3_app
    rng = np.random.default_rng(4)
    dataset, job = trained["dataset"], trained["job"]
    assert f"datasets/{dataset}.safetensors" in _objects(s3, "datasets/")
    key = f"checkpoints/{job['id']}.safetensors"
    assert job["checkpoint"]["path"] == key
    # The run's directory (its epoch checkpoints, their pointer, result.json) is in the bucket too.
    runs = _objects(s3, f"runs/{job['id']}/")
    assert f"runs/{job['id']}/result.json" in runs and any(k.endswith("model.safetensors") for k in runs), runs

    stored = s3.client().get_object(Bucket=BUCKET, Key=f"{ROOT}/{key}")["Body"].read()
    reply = httpx.get(f"{base}/train/{job['id']}/checkpoint", headers=AUTH, timeout=60)
    assert reply.status_code == 200 and reply.content == stored

    reply = httpx.post(base + "/weights", json={"job_id": job["id"]}, headers=AUTH, timeout=300)
    assert reply.status_code == 200, reply.text
    sha = hashlib.sha256(stored).hexdigest()
    assert reply.json()["gang"]["weights_sha256"] == sha
    assert f"weights/{sha}.safetensors" in _objects(s3, "weights/")

    # The reference holds the checkpoint as boto3 read it from the bucket.
    trained = st_load_torch(stored)
    q = rng.standard_normal((2, 5, 512), dtype=np.float32)
    reply = httpx.post(base + "/infer", json={"hidden_states": q.tolist()}, timeout=60)
    assert reply.status_code == 200, reply.text
    want = dense_attention(trained, 8, torch.from_numpy(q))
    assert relative_error(torch.tensor(reply.json()["output"]), want) < 1e-5

    # No artifact went to the local state dir: it holds the records and the node cache.
    local = {p.relative_to(state).parts[0] for p in state.rglob("*") if p.is_file()}
    assert not local & {"datasets", "checkpoints", "runs", "weights"}, sorted(local)
    assert (state / "cache" / f"{sha}.safetensors").is_file()


def test_a_store_lost_mid_run_answers_503_not_500(s3_app: tuple[str, Path], s3: MotoS3,
                                                  trained: dict[str, Any]) -> None:
    """Stops the store for good: the module's last test (the module fixture's server is its own)."""
    base, _ = s3_app
    finished = [trained["job"]["id"]]
    datasets = httpx.get(base + "/datasets", headers=AUTH, timeout=30).json()["datasets"]
    assert trained["dataset"] in [d["id"] for d in datasets], datasets
    datasets = [d for d in datasets if d["id"] == trained["dataset"]]
    s3.stop()
    body = st_save({"inputs": np.zeros((2, 3), np.float32), "targets": np.zeros((2, 1), np.float32)})
    for reply in (
        httpx.post(base + "/datasets", content=body, timeout=120,
                   headers={**AUTH, "content-type": "application/x-safetensors"}),
        httpx.get(f"{base}/train/{finished[0]}/checkpoint", headers=AUTH, timeout=120),
        httpx.post(base + "/weights", json={"job_id": finished[0]}, headers=AUTH, timeout=120),
        httpx.delete(f"{base}/datasets/{datasets[0]['id']}", headers=AUTH, timeout=120),
    ):
        assert reply.status_code == 503, (reply.request.url, reply.status_code, reply.text)
        doc = reply.json()
        assert doc["code"] == "storage_unavailable" and f"s3://{BUCKET}/{ROOT}" in doc["error"], doc
        assert "Retry-After" in reply.headers
    # Nothing was half-done: the dataset whose file could not be removed keeps its record.
    listed = httpx.get(base + "/datasets", headers=AUTH, timeout=30).json()["datasets"]
    assert datasets[0]["id"] in [d["id"] for d in listed]
    # What is loaded keeps serving.
    reply = httpx.post(base + "/infer", json={"hidden_states": [[0.5] * 512]}, timeout=60)
    assert reply.status_code == 200, reply.text
