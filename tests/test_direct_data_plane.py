"""The direct data plane (`direct_data_plane: true`): the GangServer replica serves POST
/infer itself (service.ingress.direct), and the client's direct mode uses it.

Unit tests run a real DirectDataPlane (uvicorn on a real port) with exact numpy arithmetic
behind it; the Ray tests deploy ONE world-size-2 app with the direct data plane and an
inference token (GANGSERVE_INFER_TOKEN in the GangServer's and the ingress's environment),
check its answers against the independent dense reference (torch's MultiheadAttention),
and compare its errors with the ingress's for the same bodies.
"""
from __future__ import annotations

import asyncio
import io
import json
import socket
import time
from typing import Any, Iterator
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import torch

from gangserve_client import GangServeClient
from harness.local import free_port
from service.config import AppConfig
from service.ingress import codecs
from tests.conftest import TEST_API_TOKEN, local_yaml_args, wait_ready
from tests.helpers import assert_error, eventually, npy_bytes, rand
from tests.reference import dense_attention_masked, notes_seed_weights, relative_error

INFER_TOKEN = "direct-infer-token-24680"
BEARER = {"authorization": f"Bearer {INFER_TOKEN}"}
WEIGHTS = notes_seed_weights(512)
TOL = 1e-5


def reference(x: np.ndarray, mask: np.ndarray | None = None) -> torch.Tensor:
    m = None if mask is None else torch.from_numpy(np.asarray(mask, dtype=np.int64))
    return dense_attention_masked(WEIGHTS, 8, torch.from_numpy(np.asarray(x, dtype=np.float32)), m, False)


def check(out: np.ndarray, x: np.ndarray, mask: np.ndarray | None = None) -> None:
    assert out.shape == x.shape, (out.shape, x.shape)
    err = relative_error(torch.from_numpy(np.array(out, dtype=np.float32)), reference(x, mask))
    assert err <= TOL, f"relative error {err:.3e}"


def refused(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True


# -- unit: a real server on a real port, exact arithmetic behind it -------------------------

async def _double(x: np.ndarray, mask: Any = None, causal: Any = None, timeout_s: float | None = None) -> np.ndarray:
    assert timeout_s is not None and timeout_s > 0  # every request carries its deadline
    return 2.0 * x


@pytest.mark.unit
def test_plane_serves_refuses_a_taken_port_and_closes_at_drain(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Any) -> None:
    monkeypatch.setenv("GANGSERVE_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("GANGSERVE_API_TOKEN", "unit-api-token")
    monkeypatch.setenv("GANGSERVE_INFER_TOKEN", INFER_TOKEN)
    from service.ingress.direct import DirectDataPlane

    async def main() -> None:
        plane = DirectDataPlane(AppConfig(), _double)
        url = await plane.start("127.0.0.1", 0)
        assert url is not None and url.startswith("http://127.0.0.1:")
        x = rand(1, 3, 512)
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(url + "/infer", content=npy_bytes(x), headers={"content-type": codecs.NPY, **BEARER})
            assert r.status_code == 200, r.text
            assert np.array_equal(np.load(io.BytesIO(r.content)), 2.0 * x)
            assert [p.split(";")[0].strip() for p in r.headers["server-timing"].split(",")] == \
                ["read", "decode", "gang", "encode"]
            r = await c.post(url + "/infer", content=npy_bytes(x), headers={"content-type": codecs.NPY})
            assert_error(r, 401, "missing_token")
            r = await c.get(url + "/gang", headers=BEARER)  # data plane only
            assert_error(r, 404, "not_found")
            # A fixed port that is taken: no server, said why, nothing raised.
            taken = DirectDataPlane(AppConfig(), _double)
            assert await taken.start("127.0.0.1", int(url.rsplit(":", 1)[1])) is None
            assert taken.error and "in use" in taken.error, taken.error
            await _async_client_direct_mode(url)
            assert await plane.drain(5.0)
        assert plane.url is None and refused(url)

    asyncio.run(main())


async def _async_client_direct_mode(url: str) -> None:
    """AsyncGangServeClient's direct mode against a real plane standing in for both ends: its
    base URL has no /gangs (404), so the request takes the "ingress" (the base URL); given a
    data URL it goes there; given a refused one it falls back."""
    from gangserve_client import AsyncGangServeClient

    x = rand(1, 2, 512, seed=9)
    async with AsyncGangServeClient(url, infer_token=INFER_TOKEN, direct=True, retries=0) as client:
        assert np.array_equal(await client.infer(x, fmt="npy"), 2.0 * x)
        assert client.direct_stats == {"direct": 0, "ingress": 1, "fallbacks": 0}
        client._direct.update({"gangs": [{"state": "ready", "data_url": url}]})  # type: ignore[union-attr]
        assert np.array_equal(await client.infer(x, fmt="npy"), 2.0 * x)
        assert client.direct_stats == {"direct": 1, "ingress": 1, "fallbacks": 0}
        client._direct.update({"gangs": [{"state": "ready", "data_url": f"http://127.0.0.1:{free_port()}"}]})  # type: ignore[union-attr]
        assert np.array_equal(await client.infer(x, fmt="npy"), 2.0 * x)
        assert client.direct_stats == {"direct": 1, "ingress": 2, "fallbacks": 1}


# -- Ray: one app with the direct data plane and an inference token ------------------------

@pytest.fixture(scope="module")
def direct_app(serve_url: str) -> Iterator[str]:
    """The local app (world size 2) with `direct_data_plane: true`; GANGSERVE_INFER_TOKEN in
    both the GangServer's and the ingress's environment (how an operator sets it)."""
    from ray import serve
    from ray.serve.deployment import Application

    from service.app import compose_app, parse_args

    app = compose_app(parse_args({**local_yaml_args(), "warm_spare": False, "direct_data_plane": True}))

    def with_token(deployment: Any) -> Any:
        options = dict(deployment.ray_actor_options or {})
        env = dict((options.get("runtime_env") or {}).get("env_vars") or {})
        options["runtime_env"] = {"env_vars": {**env, "GANGSERVE_INFER_TOKEN": INFER_TOKEN}}
        return deployment.options(ray_actor_options=options)

    ingress = app._bound_deployment
    server: Application = ingress.init_args[0]
    gang = with_token(server._bound_deployment).bind(*server._bound_deployment.init_args,
                                                     **server._bound_deployment.init_kwargs)
    serve.run(with_token(ingress).bind(gang, *ingress.init_args[1:], **ingress.init_kwargs),
              name="direct", route_prefix="/direct", blocking=False)
    base = wait_ready(serve_url + "/direct", 180, "app direct")
    yield base
    try:  # the last test deletes it already
        serve.delete("direct")
    except Exception:  # noqa: BLE001
        pass


def data_url(base: str) -> str:
    info = eventually(lambda: httpx.get(base + "/gang", timeout=30).json().get("data_url"), 30,
                      "/gang advertises data_url")
    return info


@pytest.mark.ray
def test_data_url_is_advertised_on_gang_and_gangs(direct_app: str) -> None:
    url = data_url(direct_app)
    parts = urlsplit(url)
    assert parts.scheme == "http" and parts.port and parts.port > 0, url
    gang = httpx.get(direct_app + "/gang", timeout=30).json()
    assert parts.hostname == gang["ranks"][0]["node_ip"], (url, gang["ranks"][0])  # rank 0's node address
    rows = eventually(lambda: [g for g in httpx.get(direct_app + "/gangs", timeout=30).json()["gangs"]
                               if g.get("data_url")], 30, "/gangs carries data_url")
    assert [g["data_url"] for g in rows] == [url]


@pytest.mark.ray
def test_direct_infer_matches_the_reference_npy_json_mask_and_oip(direct_app: str) -> None:
    url = data_url(direct_app)
    x = rand(2, 5, 512, seed=1)
    r = httpx.post(url + "/infer", content=npy_bytes(x), headers={"content-type": codecs.NPY, **BEARER}, timeout=60)
    assert r.status_code == 200, r.text
    check(np.load(io.BytesIO(r.content)), x)
    assert {p.split(";")[0].strip() for p in r.headers["server-timing"].split(",")} == {"read", "decode", "gang", "encode"}
    r = httpx.post(url + "/infer", json={"hidden_states": x.tolist()}, headers=BEARER, timeout=60)
    assert r.status_code == 200, r.text
    check(np.asarray(r.json()["output"], dtype=np.float32), x)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    r = httpx.post(url + "/infer", json={"hidden_states": x.tolist(), "attention_mask": mask.tolist()},
                   headers=BEARER, timeout=60)
    assert r.status_code == 200, r.text
    out = np.asarray(r.json()["output"], dtype=np.float32)
    check(out, x, mask)
    assert (out[mask == 0] == 0).all()
    oip = {"inputs": [{"name": "hidden_states", "shape": list(x.shape), "datatype": "FP32",
                       "data": x.ravel().tolist()}]}
    r = httpx.post(url + "/v2/models/attention/infer", json=oip, headers=BEARER, timeout=60)
    assert r.status_code == 200, r.text
    check(np.asarray(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(x.shape), x)


@pytest.mark.ray
def test_bad_input_gets_the_ingress_code_and_the_server_keeps_serving(direct_app: str) -> None:
    url = data_url(direct_app)
    good = npy_bytes(rand(1, 3, 512, seed=2))
    cases = [
        ("wrong embed dim", npy_bytes(rand(1, 3, 256)), {"content-type": codecs.NPY}),
        ("bad deadline", good, {"content-type": codecs.NPY, "x-request-timeout-seconds": "-1"}),
        ("not npy", b"nope", {"content-type": codecs.NPY}),
        ("bad media type", good, {"content-type": "text/plain"}),
        ("bad mask", json.dumps({"hidden_states": [[0.0] * 512], "attention_mask": [2]}).encode(),
         {"content-type": codecs.JSON}),
    ]
    for what, body, headers in cases:
        at_ingress = httpx.post(direct_app + "/infer", content=body, headers={**headers, **BEARER}, timeout=60)
        direct = httpx.post(url + "/infer", content=body, headers={**headers, **BEARER}, timeout=60)
        assert 400 <= direct.status_code < 500, (what, direct.status_code, direct.text)
        doc = assert_error(direct, at_ingress.status_code, at_ingress.json()["code"])
        assert doc == at_ingress.json(), (what, doc, at_ingress.json())
    assert httpx.post(url + "/infer", content=good, headers={"content-type": codecs.NPY,
                      "x-request-timeout-seconds": "-1", **BEARER}, timeout=60).json()["code"] == "invalid_deadline"
    r = httpx.post(url + "/infer", content=good, headers={"content-type": codecs.NPY, **BEARER}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.ray
def test_the_inference_token_is_enforced_before_the_body_is_read(direct_app: str) -> None:
    url = data_url(direct_app)
    body = npy_bytes(rand(1, 2, 512))
    for path in ("/infer", "/v2/models/attention/infer"):
        for headers, code in (({}, "missing_token"), ({"authorization": "Bearer nope"}, "invalid_token")):
            r = httpx.post(url + path, content=body, headers={"content-type": codecs.NPY, **headers}, timeout=30)
            assert_error(r, 401, code)
            assert r.headers["www-authenticate"].startswith("Bearer")
    r = httpx.post(url + "/infer", content=body, timeout=60,
                   headers={"content-type": codecs.NPY, "authorization": f"Bearer {TEST_API_TOKEN}"})
    assert r.status_code == 200, r.text  # the API token is accepted too, as on the ingress


@pytest.mark.ray
def test_client_direct_mode_and_its_fallback_to_the_ingress(direct_app: str) -> None:
    x = rand(1, 4, 512, seed=3)
    with GangServeClient(direct_app, infer_token=INFER_TOKEN, direct=True, retries=0) as client:
        for fmt in ("npy", "json"):
            check(client.infer(x, fmt=fmt), x)
        assert client.direct_stats == {"direct": 2, "ingress": 0, "fallbacks": 0}, client.direct_stats
        # A data URL nobody listens on (the gang server moved, a port closed): the request
        # takes the ingress at once, and the next ones too until the URLs are read again.
        closed = f"http://127.0.0.1:{free_port()}"
        client._direct.update({"gangs": [{"state": "ready", "data_url": closed}]})  # type: ignore[union-attr]
        started = time.monotonic()
        check(client.infer(x, fmt="npy"), x)
        assert time.monotonic() - started < 10
        assert client.direct_stats == {"direct": 2, "ingress": 1, "fallbacks": 1}, client.direct_stats
    # Without the flag nothing changes: the ingress only.
    with GangServeClient(direct_app, infer_token=INFER_TOKEN) as plain:
        check(plain.infer(x), x)
        assert plain.direct_stats["direct"] == 0


@pytest.mark.ray
def test_cli_direct(direct_app: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from gangserve_client.cli import main

    x = rand(1, 2, 512, seed=4)
    src, dst = tmp_path / "x.npy", tmp_path / "y.npy"
    np.save(src, x)
    assert main(["--url", direct_app, "--direct", "infer", str(src), "-o", str(dst), "--format", "npy",
                 "--token", INFER_TOKEN]) == 0, capsys.readouterr()
    check(np.load(dst), x)


@pytest.mark.ray
def test_a_broken_gang_answers_503_at_once_and_hides_its_url(direct_app: str) -> None:
    """kill -9 of rank 1: while the gang rebuilds, the direct server answers 503 (JSON, a
    gang_* code, Retry-After) instead of holding the request, /gang stops advertising the
    URL, and the client's direct mode still gets the right answer (through the ingress);
    once rebuilt, the same URL serves again."""
    import os
    import signal

    url = data_url(direct_app)
    victim = httpx.get(direct_app + "/gang", timeout=30).json()["ranks"][1]["pid"]
    x = rand(1, 3, 512, seed=5)
    body, headers = npy_bytes(x), {"content-type": codecs.NPY, **BEARER}
    os.kill(victim, signal.SIGKILL)
    seen: list[dict[str, Any]] = []

    def refused_503() -> bool:
        r = httpx.post(url + "/infer", content=body, headers=headers, timeout=60)
        if r.status_code == 503:
            seen.append(assert_error(r, 503))
            assert r.headers.get("retry-after"), r.headers
            return True
        assert r.status_code == 200, r.text  # before the loss is noticed
        return False

    eventually(refused_503, 60, "a 503 from the direct server while the gang is broken", interval_s=0.05)
    assert seen[0]["code"].startswith("gang_"), seen
    info = httpx.get(direct_app + "/gang", timeout=30).json()
    assert info["state"] == "ready" or "data_url" not in info, info
    with GangServeClient(direct_app, infer_token=INFER_TOKEN, direct=True) as client:
        check(client.infer(x, fmt="npy"), x)  # the ingress waits for the rebuild
    assert data_url(direct_app) == url
    r = httpx.post(url + "/infer", content=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    check(np.load(io.BytesIO(r.content)), x)


@pytest.mark.ray
def test_the_port_closes_when_the_replica_drains(direct_app: str) -> None:
    """Last in the module: deleting the app drains the replica (GangServer.__del__)."""
    from ray import serve

    url = data_url(direct_app)
    assert not refused(url)
    serve.delete("direct")
    eventually(lambda: refused(url), 60, f"{url} refuses connections after the replica drained")
