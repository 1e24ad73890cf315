"""The client distribution (./clients: gangserve-client, import gangserve_client, command `gangserve`).

- It installs alone: a fresh venv, `pip install ./clients` under constraints.txt, no torch,
  Ray, FastAPI or uvicorn, and its `gangserve infer` answers what the dense reference says
  (real Ray, Serve and HTTP: the shared app of tests/conftest.py).
- One implementation of the wire formats and of the token rule: the service imports them
  from the client, and the client's modules import nothing of the server's.
- Retries (stamina, sync and async) and typed errors, against real HTTP servers: a scripted
  one on a local socket for the failures a healthy service never shows, the real service
  for the training calls' errors.
"""
from __future__ import annotations

import ast
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from gangserve_client import (
    AsyncGangServeClient,
    AuthError,
    GangServeClient,
    InvalidInputError,
    NotFoundError,
    QuotaExceededError,
    ServiceUnreachableError,
    TrainingClient,
    UnavailableError,
)
from gangserve_client import codecs as wire
from gangserve_client import tokens
from harness.local import free_port
from harness.reference import reference, relative_error
from tests.conftest import ROOT, TEST_API_TOKEN
from tests.helpers import rand

CLIENT_DIR = ROOT / "clients"
CLIENT_PACKAGE = CLIENT_DIR / "gangserve_client"
SERVER_ONLY = ("torch", "ray", "fastapi", "uvicorn", "starlette", "pydantic", "safetensors", "service")


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (absolute imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


# ---- one place for each concern (no Ray) ----------------------------------------------------

@pytest.mark.unit
def test_the_client_imports_nothing_of_the_server() -> None:
    allowed = {"numpy", "httpx", "orjson", "stamina", "ml_dtypes", "gangserve_client", "__future__"}
    for path in sorted(CLIENT_PACKAGE.glob("*.py")):
        third_party = {n for n in imported_modules(path) if n not in sys.stdlib_module_names}
        assert third_party <= allowed, (path.name, sorted(third_party - allowed))


@pytest.mark.unit
def test_the_service_codecs_and_token_rule_are_the_clients() -> None:
    from service.ingress import auth, codecs

    assert codecs.wire is wire
    # service/ingress/codecs.py parses no format itself: no header parsing, no orjson, no struct.
    text = (ROOT / "service" / "ingress" / "codecs.py").read_text()
    assert not {"ast", "struct", "orjson", "io", "reprlib"} & imported_modules(ROOT / "service" / "ingress" / "codecs.py")
    assert "literal_eval" not in text and "frombuffer(view" not in text
    assert auth.tokens is tokens and "os.environ" not in (ROOT / "service" / "ingress" / "auth.py").read_text()


@pytest.mark.unit
def test_the_client_modules_import_each_other_without_a_circle() -> None:
    from graphlib import TopologicalSorter

    modules = {p.stem for p in CLIENT_PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    graph: dict[str, set[str]] = {}
    for stem in sorted(modules):
        graph[stem] = set()
        for node in ast.walk(ast.parse((CLIENT_PACKAGE / f"{stem}.py").read_text())):
            module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            if module == "gangserve_client":  # from gangserve_client import codecs, tokens
                graph[stem] |= {alias.name for alias in getattr(node, "names", ())} & modules
            elif module.startswith("gangserve_client."):
                graph[stem].add(module.split(".")[1])
    TopologicalSorter(graph).prepare()  # raises CycleError naming the circle
    assert {"sessions", "replies"} <= graph["client"], graph  # the walk sees the imports


@pytest.mark.unit
def test_bench_does_not_import_tests() -> None:
    for path in sorted((ROOT / "bench").glob("*.py")):
        assert "tests" not in imported_modules(path), path.name


@pytest.mark.unit
def test_client_and_service_find_the_same_api_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    script: Any) -> None:
    from service.ingress.auth import load_api_token

    monkeypatch.delenv("GANGSERVE_API_TOKEN", raising=False)
    monkeypatch.setenv("GANGSERVE_STATE_DIR", str(tmp_path / "state"))
    assert tokens.api_token() is None  # nothing yet: the client finds nothing and creates nothing
    assert not (tmp_path / "state").exists()
    created, where = load_api_token()  # the service creates it ...
    found = tokens.api_token()  # ... and the client reads that one
    assert found is not None and (found.value, found.source) == (created, where)
    server = script([(200, {}, b'{"jobs": [], "next": null}')])
    with TrainingClient(server.url) as client:  # what it sends, as a server sees it
        client.jobs()
    assert server.authorization == [f"Bearer {created}"], server.authorization
    monkeypatch.setenv("GANGSERVE_API_TOKEN", "  from-env  ")  # the environment wins, stripped, on both sides
    assert load_api_token()[0] == tokens.api_token().value == "from-env"
    monkeypatch.setenv("GANGSERVE_INFER_TOKEN", " infer ")
    from service.ingress.auth import load_infer_token

    assert load_infer_token() == tokens.infer_token() == "infer"


@pytest.mark.unit
def test_codec_errors_are_typed_and_bounded_on_the_client_too() -> None:
    """The shared codecs raise WireFormatError (a ValueError) in the client; the service maps
    the same failures to its HTTP errors (tests/test_codecs.py, tests/test_hardening.py)."""
    cases = [
        (lambda: wire.decode_npy(b"\x93NUMPY\x01\x00" + b"\xff" * 64), wire.MalformedError),
        (lambda: wire.decode_safetensors(b"\x01\x00"), wire.MalformedError),
        (lambda: wire.decode_json(b'{"output": [["a"]]}', name="output"), wire.InvalidTensorError),
        (lambda: wire.decode_json(b"[" * 100_000), wire.MalformedError),
        (lambda: wire.encode_safetensors({"x": np.arange(3)}), wire.UnencodableError),
        (lambda: wire.encode_npy(np.zeros(2, ml_dtypes.bfloat16)), wire.InvalidTensorError),
    ]
    for call, cls in cases:
        with pytest.raises(cls) as info:
            call()
        assert isinstance(info.value, ValueError) and 0 < len(info.value.message) <= wire.MAX_MESSAGE_CHARS


# ---- retries and typed errors against a scripted HTTP server (no Ray) ------------------------

class Script:
    """A real HTTP server on 127.0.0.1 answering each request with the next scripted step:
    (status, headers, body) or "drop" (close the connection without a reply)."""

    def __init__(self, steps: list[Any], port: int = 0) -> None:
        self.steps, self.seen = list(steps), []
        self.authorization: list[str | None] = []  # each request's Authorization header
        script = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                script.seen.append((self.command, self.path))
                script.authorization.append(self.headers.get("authorization"))
                step = script.steps.pop(0) if script.steps else (200, {}, b"{}")
                if step == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                status, headers, body = step
                self.send_response(status)
                for key, value in {"content-type": "application/json", **headers}.items():
                    self.send_header(key, value)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def script() -> Iterator[Any]:
    servers: list[Script] = []

    def start(steps: list[Any], port: int = 0) -> Script:
        servers.append(Script(steps, port))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def error(status: int, code: str, retry_after: str | None = None) -> tuple[int, dict[str, str], bytes]:
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    return status, headers, json.dumps({"error": f"scripted {code}", "code": code}).encode()


def npy_reply(array: np.ndarray) -> tuple[int, dict[str, str], bytes]:
    return 200, {"content-type": wire.NPY}, wire.encode_npy(array)


@pytest.mark.unit
def test_503_and_429_with_retry_after_are_retried_with_backoff_sync_and_async(script: Any) -> None:
    y = rand(1, 2, 4, seed=1)
    steps = [error(503, "gang_rebuilding", "0"), error(429, "overloaded", "0.2"), npy_reply(y)]
    server = script(list(steps))
    with GangServeClient(server.url) as client:
        start = time.monotonic()
        assert np.array_equal(client.infer(y, "npy"), y)
        waited = time.monotonic() - start
    assert server.seen == [("POST", "/infer")] * 3
    assert 0.25 + 0.5 <= waited < 10  # exponential: 0.25 s, then 0.5 s (above Retry-After 0.2), plus jitter

    server.steps = list(steps)

    async def main() -> np.ndarray:
        async with AsyncGangServeClient(server.url) as client:
            return await client.infer(y, "npy")

    assert np.array_equal(asyncio.run(main()), y)
    assert len(server.seen) == 6


@pytest.mark.unit
def test_retries_are_bounded_by_attempts_and_raise_the_typed_error(script: Any) -> None:
    server = script([error(503, "gang_starting", "0")] * 10)
    with GangServeClient(server.url, retries=2) as client, pytest.raises(UnavailableError) as info:
        client.gang()
    assert len(server.seen) == 3 and info.value.code == "gang_starting" and info.value.retry_after_s == 0.0
    # A 503 without Retry-After, and a 429 quota (no Retry-After: it fits once jobs end), are not retried.
    server.seen.clear()
    server.steps = [error(503, "gang_broken"), error(429, "quota_exceeded")]
    with GangServeClient(server.url) as client, pytest.raises(UnavailableError):
        client.gang()
    with TrainingClient(server.url, token="t") as client, pytest.raises(QuotaExceededError) as quota:
        client.submit({})
    assert len(server.seen) == 2 and quota.value.status == 429


@pytest.mark.unit
def test_retries_are_bounded_by_time(script: Any) -> None:
    server = script([error(503, "gang_starting", "1")] * 100)
    start = time.monotonic()
    with GangServeClient(server.url, retries=100, retry_timeout_s=2.0) as client, pytest.raises(UnavailableError):
        client.gang()
    assert time.monotonic() - start < 6 and 2 <= len(server.seen) <= 5


@pytest.mark.unit
def test_connection_refused_is_retried_until_the_service_listens(script: Any) -> None:
    port = free_port()
    y = rand(2, 4, seed=2)
    late: list[Script] = []
    starter = threading.Timer(0.6, lambda: late.append(script([npy_reply(y)], port=port)))
    starter.start()
    try:
        with GangServeClient(f"http://127.0.0.1:{port}", retries=6) as client:
            assert np.array_equal(client.infer(y, "npy"), y)
    finally:
        starter.join()
    assert late and late[0].seen == [("POST", "/infer")]

    async def refused() -> None:
        async with AsyncGangServeClient(f"http://127.0.0.1:{free_port()}", retries=1) as client:
            await client.gang()

    with pytest.raises(ServiceUnreachableError) as info:
        asyncio.run(refused())
    assert isinstance(info.value, ConnectionError) and info.value.__cause__ is not None


@pytest.mark.unit
def test_a_dropped_connection_is_retried_only_when_resending_is_safe(script: Any) -> None:
    job = {"id": "job-1", "status": "PENDING"}
    server = script(["drop", (200, {}, json.dumps(job).encode())])
    with TrainingClient(server.url, token="t") as client:
        assert client.job("job-1") == job  # a GET: asked again
        server.steps = ["drop", (202, {}, json.dumps(job).encode())]
        with pytest.raises(ServiceUnreachableError):
            client.submit({})  # a submission that may have arrived: not sent twice
    assert server.seen == [("GET", "/train/job-1")] * 2 + [("POST", "/train")]


# ---- against the service (real Ray, Serve, HTTP) -------------------------------------------

@pytest.mark.ray
def test_training_calls_raise_typed_errors(app_url: str) -> None:
    with TrainingClient(app_url, token="not-the-token") as client, pytest.raises(AuthError) as auth:
        client.jobs()
    assert auth.value.status == 401 and auth.value.code == "invalid_token"
    with TrainingClient(app_url, token=TEST_API_TOKEN) as client:
        with pytest.raises(NotFoundError):
            client.job("job-doesnotexist")
        with pytest.raises(InvalidInputError) as invalid:
            client.submit({"epochs": 0})
        assert invalid.value.status == 422 and "epochs" in invalid.value.message


@pytest.mark.ray
def test_inference_sends_the_inference_token(app_url: str, monkeypatch: pytest.MonkeyPatch, script: Any) -> None:
    """The client sends $GANGSERVE_INFER_TOKEN on inference (a service without one ignores it)."""
    monkeypatch.setenv("GANGSERVE_INFER_TOKEN", "some-inference-token")
    x = rand(1, 3, 512, seed=3)
    server = script([npy_reply(x)])  # what it sends, as a server sees it
    with GangServeClient(server.url) as client:
        client.infer(x, "npy")
    assert server.authorization == ["Bearer some-inference-token"], server.authorization
    with GangServeClient(app_url) as client:
        assert relative_error(torch.from_numpy(np.array(client.infer(x, "json"))), reference(x)) < 1e-5


def _fresh_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.ray
def test_pip_install_clients_alone_and_gangserve_infer(app_url: str, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = _fresh_env(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q",
           "-c", str(ROOT / "constraints.txt")]
    install = subprocess.run(pip + [str(CLIENT_DIR)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=900)
    assert install.returncode == 0, install.stdout + install.stderr
    assert not [p.name for p in CLIENT_DIR.iterdir() if p.name in ("build", "dist") or p.name.endswith(".egg-info")]

    python = str(venv / "bin" / "python")
    probe = ("import importlib.util as u, importlib.metadata as m, json; "
             f"print(json.dumps({{'missing': [n for n in {list(SERVER_ONLY) + ['ml_dtypes']!r} if u.find_spec(n) is None], "
             "'stamina': m.version('stamina'), 'client': m.version('gangserve-client'), "
             "'where': u.find_spec('gangserve_client').origin}))")
    found = json.loads(subprocess.run([python, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                                      timeout=120, check=True).stdout)
    assert sorted(found["missing"]) == sorted([*SERVER_ONLY, "ml_dtypes"]), found  # none of them installed
    assert found["stamina"] == "26.1.0" and found["client"] == "0.1.0"
    assert found["where"].startswith(str(venv)), found  # the installed copy, not this checkout

    gangserve = str(venv / "bin" / "gangserve")
    x = rand(2, 3, 512, seed=4)
    np.save(tmp_path / "in.npy", x)

    def run(*args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([gangserve, "--url", app_url, *args], cwd=tmp_path, env={**env, **extra_env},
                              capture_output=True, text=True, timeout=180)

    for fmt, out_name in (("safetensors", "out.safetensors"), ("json", "out.npy"), ("npy", "out2.npy")):
        proc = run("infer", str(tmp_path / "in.npy"), "--format", fmt, "-o", str(tmp_path / out_name))
        assert proc.returncode == 0, proc.stderr
        assert "output shape [2, 3, 512] dtype float32" in proc.stdout
        body = (tmp_path / out_name).read_bytes()
        out = wire.decode_safetensors(body, "output") if out_name.endswith(".safetensors") else wire.decode_npy(body)
        assert relative_error(torch.from_numpy(np.array(out)), reference(x)) < 1e-5

    gang = run("gang")
    assert gang.returncode == 0 and json.loads(gang.stdout)["world_size"] == 2
    assert run("jobs", GANGSERVE_API_TOKEN=TEST_API_TOKEN).returncode == 0
    refused = run("jobs", GANGSERVE_API_TOKEN="wrong")
    assert refused.returncode == 1 and "401" in refused.stderr

    # bfloat16 needs the extra: without it, a clear refusal; with it, a round trip.
    x16 = x.astype(ml_dtypes.bfloat16)
    (tmp_path / "in16.safetensors").write_bytes(wire.encode_safetensors({"hidden_states": x16}))
    no_extra = run("infer", str(tmp_path / "in16.safetensors"))
    assert no_extra.returncode == 1 and "gangserve-client[bfloat16]" in no_extra.stderr, no_extra.stderr
    extra = subprocess.run(pip + [f"{CLIENT_DIR}[bfloat16]"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    assert extra.returncode == 0, extra.stdout + extra.stderr
    proc = run("infer", str(tmp_path / "in16.safetensors"), "-o", str(tmp_path / "out16.safetensors"),
               "--output-dtype", "float32")
    assert proc.returncode == 0 and "dtype float32" in proc.stdout, proc.stderr
    out = wire.decode_safetensors((tmp_path / "out16.safetensors").read_bytes(), "output")
    assert relative_error(torch.from_numpy(np.array(out)), reference(x16.astype(np.float32))) < 1e-5
