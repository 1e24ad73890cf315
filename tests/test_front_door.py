"""The front door (service.cluster.front_door): Serve's HAProxy on the HTTP port, straight to
the ingress replicas, set up the same way everywhere the service is started, and what a
plain client and `tritonclient` get through it."""
from __future__ import annotations

import io
import re
import subprocess
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
import yaml

from harness.local import ROOT
from service.cluster.front_door import FRONT_DOOR_ENV, missing_front_door_env, warn_if_slow_front_door
from tests.helpers import npy_bytes, rand
from tests.reference import dense_attention, notes_seed_weights, relative_error

SEED_WEIGHTS = notes_seed_weights(512)


@pytest.mark.unit
def test_missing_env_names_each_variable_and_what_was_found() -> None:
    assert missing_front_door_env(dict(FRONT_DOOR_ENV)) == {}
    assert missing_front_door_env({}) == {name: None for name in FRONT_DOOR_ENV}
    assert missing_front_door_env({**FRONT_DOOR_ENV, "RAY_SERVE_ENABLE_HA_PROXY": "0"}) == {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    assert warn_if_slow_front_door(dict(FRONT_DOOR_ENV)) is True
    assert warn_if_slow_front_door({}) is False


@pytest.mark.unit
def test_make_serve_sets_the_front_door_env() -> None:
    makefile = (ROOT / "Makefile").read_text()
    line = re.search(r"^FRONT_DOOR_ENV := (.*)$", makefile, re.M)
    assert line, "Makefile defines FRONT_DOOR_ENV"
    assert dict(pair.split("=", 1) for pair in line.group(1).split()) == dict(FRONT_DOOR_ENV)
    serve_recipe = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "env $(FRONT_DOOR_ENV) $(VENV)/bin/serve run deployments/local.yaml" in serve_recipe


@pytest.mark.unit
def test_dockerfile_sets_the_front_door_env() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    env_block = dockerfile.split("\nENV ", 1)[1].split("\n\n", 1)[0]
    found = dict(re.findall(r"(RAY_SERVE_[A-Z_]+)=(\S+)", env_block))
    assert found == dict(FRONT_DOOR_ENV)


@pytest.mark.unit
def test_kuberay_head_and_workers_set_the_front_door_env() -> None:
    docs = [d for d in yaml.safe_load_all((ROOT / "deployments" / "kuberay.yaml").read_text()) if d]
    service = next(d for d in docs if d.get("kind") == "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        for container in pod["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert {k: env.get(k) for k in FRONT_DOOR_ENV} == dict(FRONT_DOOR_ENV), container["name"]


def listener_process(port: int) -> str:
    """The name of the process listening on 127.0.0.1:`port` (from `ss -ltnp`)."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    names = set(re.findall(r'users:\(\("([^"]+)"', out))
    assert names, f"nothing listens on port {port}: {out!r}"
    return ",".join(sorted(names))


@pytest.mark.ray
def test_the_http_port_is_haproxy(app_url: str) -> None:
    """The suite's Serve instance runs as `make serve` does: HAProxy owns the HTTP port (not
    Serve's Python proxy, a `ray::ProxyActor` process)."""
    assert listener_process(urlsplit(app_url).port or 80) == "haproxy"


@pytest.mark.ray
def test_plain_http_through_the_front_door_matches_the_dense_reference(app_url: str) -> None:
    x = rand(3, 7, 512, seed=11)
    with httpx.Client(timeout=60) as client:
        r = client.post(app_url + "/infer", content=npy_bytes(x), headers={"content-type": "application/x-npy"})
        assert r.status_code == 200, r.text
        got = torch.from_numpy(np.load(io.BytesIO(r.content), allow_pickle=False))
        assert relative_error(got, dense_attention(SEED_WEIGHTS, 8, torch.from_numpy(x))) < 1e-5
        # Bad input: our JSON 4xx through the front door, and the service still serves.
        bad = client.post(app_url + "/infer", content=b"not npy", headers={"content-type": "application/x-npy"})
        assert bad.status_code == 400 and bad.json()["code"] == "malformed"
        assert client.get(app_url + "/readyz").status_code == 200


@pytest.mark.ray
def test_tritonclient_through_the_front_door_matches_the_dense_reference(app_url: str) -> None:
    client = triton.InferenceServerClient(urlsplit(app_url).netloc, connection_timeout=60, network_timeout=120)
    try:
        x = rand(2, 9, 512, seed=12)
        inp = triton.InferInput("hidden_states", list(x.shape), "FP32").set_data_from_numpy(x, binary_data=True)
        out = client.infer("attention", [inp]).as_numpy("output")
        assert relative_error(torch.from_numpy(out.copy()), dense_attention(SEED_WEIGHTS, 8, torch.from_numpy(x))) < 1e-5
    finally:
        client.close()


@pytest.mark.ray
def test_a_stated_deadline_gets_our_json_504_not_the_front_doors_answer(app_url: str) -> None:
    """Serve's replica also times the X-Request-Timeout-Seconds header (a plain-text 408):
    the ingress answers first, in its own format (service.contract.deadlines)."""
    x = rand(64, 128, 512, seed=13)  # ~0.1-0.5 s of compute on this machine
    with httpx.Client(timeout=60) as client:
        r = client.post(app_url + "/infer", content=npy_bytes(x), headers={
            "content-type": "application/x-npy", "x-request-timeout-seconds": "0.02"})
    assert r.status_code == 504, (r.status_code, r.text[:200])
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["code"] == "deadline_exceeded"
