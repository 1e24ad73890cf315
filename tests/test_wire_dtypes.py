"""POST /infer with half-precision inputs, the output_dtype rule, and the Python clients.

Real Ray, real Serve, real HTTP (the shared world_size-2 app). Requests are written with
independent writers (safetensors.torch, np.save, the stdlib json module); expected values
come from tests.reference on exactly the values sent, computed in float32.
"""
from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import httpx
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load_torch
from safetensors.torch import save as st_save_torch

from gangserve_client import AsyncGangServeClient, GangServeClient, InvalidInputError
from gangserve_client import UnsupportedMediaTypeError
from tests.conftest import ROOT
from tests.reference import reference, relative_error

pytestmark = pytest.mark.ray


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def post(url: str, body: bytes, media: str, **params: str) -> httpx.Response:
    return httpx.post(url + "/infer", content=body, headers={"content-type": media}, params=params, timeout=60)


@pytest.mark.parametrize("tdtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_safetensors_half_inputs(app_url: str, tdtype: torch.dtype) -> None:
    x = rand(2, 3, 512, seed=1).to(tdtype)
    want = reference(x)  # float32 compute of exactly the half values sent
    body = st_save_torch({"hidden_states": x})
    r = post(app_url, body, "application/x-safetensors")
    assert r.status_code == 200, r.text
    out = st_load_torch(r.content)["output"]
    assert out.dtype == tdtype and out.shape == x.shape
    # The reply is the float32 result rounded to the request dtype, as torch rounds it.
    assert torch.equal(out.float().isinf(), want.to(tdtype).float().isinf())
    finite = ~out.float().isinf()
    assert torch.allclose(out.float()[finite], want.to(tdtype).float()[finite], rtol=1e-2)
    r = post(app_url, body, "application/x-safetensors", output_dtype="float32")
    out32 = st_load_torch(r.content)["output"]
    assert out32.dtype == torch.float32 and relative_error(out32, want) < 1e-5


def test_npy_and_json_half_inputs(app_url: str) -> None:
    x16 = rand(1, 4, 512, seed=2).numpy().astype(np.float16)
    want = reference(x16.astype(np.float32))
    buf = io.BytesIO()
    np.save(buf, x16)
    r = post(app_url, buf.getvalue(), "application/x-npy", output_dtype="float32")
    assert r.status_code == 200, r.text
    assert relative_error(torch.from_numpy(np.load(io.BytesIO(r.content))), want) < 1e-5
    r = post(app_url, buf.getvalue(), "application/x-npy")
    assert np.load(io.BytesIO(r.content)).dtype == np.float16
    # JSON: the declared dtype rounds the values on arrival and names the reply's dtype.
    xb = rand(1, 4, 512, seed=3).numpy()
    doc = {"hidden_states": xb.tolist(), "dtype": "bfloat16"}
    r = httpx.post(app_url + "/infer", content=json.dumps(doc), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["dtype"] == "bfloat16" and reply["shape"] == [1, 4, 512]
    want_b = reference(torch.from_numpy(xb).to(torch.bfloat16)).to(torch.bfloat16).float()
    assert relative_error(torch.tensor(reply["output"]), want_b) < 1e-2


@pytest.mark.parametrize("media, params, body, status, fragment", [
    ("application/x-npy", {"output_dtype": "bfloat16"}, None, 422, "npy cannot carry bfloat16"),
    ("application/x-npy", {"output_dtype": "int8"}, None, 422, "output_dtype"),
    ("application/x-npy", {}, b"bf16", 422, "floating-point"),
    ("application/json", {}, b'{"hidden_states": [[1.0]], "dtype": "int4"}', 422, "dtype must be one of"),
    ("application/json", {}, b'{"hidden_states": [NaN]}', 400, "invalid JSON"),
    ("application/json", {}, b'{"hidden_states": [1.0, 2.0], "shape": [1, 512]}', 422, "needs 512"),
], ids=["bf16 npy reply", "bad output_dtype", "bf16 npy request", "bad JSON dtype", "NaN literal", "shape mismatch"])
def test_dtype_errors(app_url: str, media: str, params: dict, body: bytes | None, status: int, fragment: str) -> None:
    if body is None:
        buf = io.BytesIO()
        np.save(buf, rand(1, 2, 512).numpy())
        body = buf.getvalue()
    elif body == b"bf16":  # numpy writes bfloat16 as raw 'V2' void data: not a float dtype
        buf = io.BytesIO()
        np.save(buf, rand(1, 2, 512).numpy().astype(ml_dtypes.bfloat16))
        body = buf.getvalue()
    r = post(app_url, body, media, **params)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"] and r.json()["code"]


def test_sync_client_every_format_and_dtype(app_url: str) -> None:
    x = rand(2, 3, 512, seed=4).numpy()
    want = reference(x)
    with GangServeClient(app_url) as client:
        for fmt in ("safetensors", "npy", "json"):
            out = client.infer(x, fmt)
            assert out.dtype == np.float32 and relative_error(torch.from_numpy(np.array(out)), want) < 1e-5
        xb = x.astype(ml_dtypes.bfloat16)
        for fmt in ("safetensors", "json"):
            assert client.infer(xb, fmt).dtype == ml_dtypes.bfloat16
            out = client.infer(xb, fmt, output_dtype="float32", accept="npy")
            assert relative_error(torch.from_numpy(np.array(out)), reference(xb.astype(np.float32))) < 1e-5
        with pytest.raises(InvalidInputError) as info:
            client.infer(x[..., :100])
        assert info.value.status == 422 and "embed_dim=512" in info.value.message
        with pytest.raises(UnsupportedMediaTypeError):
            client._request("POST", "/infer", content=b"x", headers={"content-type": "text/csv"})


def test_async_client_concurrent_requests(app_url: str) -> None:
    inputs = [rand(1, 2 + i, 512, seed=20 + i).numpy() for i in range(6)]

    async def main() -> list[np.ndarray]:
        async with AsyncGangServeClient(app_url) as client:
            assert await client.ready()
            assert (await client.gang())["world_size"] == 2
            fmts = ["safetensors", "npy", "json"]
            return await asyncio.gather(*(client.infer(x, fmts[i % 3]) for i, x in enumerate(inputs)))

    for x, out in zip(inputs, asyncio.run(main())):
        assert relative_error(torch.from_numpy(np.array(out)), reference(x)) < 1e-5


@pytest.fixture
def flaky_proxy(app_url: str) -> Iterator[tuple[str, list[int]]]:
    """A real HTTP proxy in front of the service that answers the first POST with 503 + Retry-After."""
    statuses: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            if not statuses:
                reply = httpx.Response(503, json={"error": "gang is rebuilding", "code": "gang_rebuilding"},
                                       headers={"retry-after": "1"})
            else:
                reply = httpx.post(app_url + self.path, content=body, headers={"content-type": self.headers["content-type"]},
                                   timeout=60)
            statuses.append(reply.status_code)
            self.send_response(reply.status_code)
            for key in ("content-type", "retry-after"):
                if key in reply.headers:
                    self.send_header(key, reply.headers[key])
            self.send_header("content-length", str(len(reply.content)))
            self.end_headers()
            self.wfile.write(reply.content)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", statuses
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_clients_retry_503_with_retry_after(flaky_proxy: tuple[str, list[int]]) -> None:
    url, statuses = flaky_proxy
    x = rand(1, 2, 512, seed=30).numpy()
    with GangServeClient(url) as client:
        out = client.infer(x, "npy")
    assert statuses == [503, 200]
    assert relative_error(torch.from_numpy(np.array(out)), reference(x)) < 1e-5
    statuses.clear()

    async def main() -> np.ndarray:
        async with AsyncGangServeClient(url) as client:
            return await client.infer(x, "safetensors")

    assert relative_error(torch.from_numpy(np.array(asyncio.run(main()))), reference(x)) < 1e-5
    assert statuses == [503, 200]
    statuses.clear()
    with GangServeClient(url, retries=0) as client:
        with pytest.raises(Exception) as info:
            client.infer(x)
    assert info.value.status == 503 and info.value.retry_after_s == 1.0 and "rebuilding" in info.value.message


def test_cli_bfloat16_safetensors_round_trip(app_url: str, tmp_path: Path) -> None:
    x = rand(2, 3, 512, seed=12).to(torch.bfloat16)
    (tmp_path / "in.safetensors").write_bytes(st_save_torch({"hidden_states": x}))
    proc = subprocess.run(
        [sys.executable, "-m", "gangserve_client", "--url", app_url, "infer", str(tmp_path / "in.safetensors"),
         "-o", str(tmp_path / "out.safetensors"), "--output-dtype", "float32"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "dtype float32" in proc.stdout
    out = st_load_torch((tmp_path / "out.safetensors").read_bytes())["output"]
    assert relative_error(out, reference(x)) < 1e-5
