"""Open Inference Protocol v2 through the stock `tritonclient[http]` client, and its bad inputs.

Real Ray, real Serve, real HTTP (the shared world_size-2 app); every expected output
comes from tests.reference (torch.nn.MultiheadAttention with the notes' seed weights).
"""
from __future__ import annotations

import json
from urllib.parse import urlsplit

import httpx
import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.reference import reference, relative_error
from tests.helpers import rand

pytestmark = pytest.mark.ray

INFER = "/v2/models/attention/infer"


@pytest.fixture(scope="module")
def triton_client(app_url: str):
    client = triton.InferenceServerClient(urlsplit(app_url).netloc, connection_timeout=60, network_timeout=120)
    yield client
    client.close()


def triton_input(x: np.ndarray, datatype: str, binary: bool) -> triton.InferInput:
    inp = triton.InferInput("hidden_states", list(x.shape), datatype)
    return inp.set_data_from_numpy(x, binary_data=binary)


def test_health_and_metadata(triton_client: triton.InferenceServerClient) -> None:
    assert triton_client.is_server_live() and triton_client.is_server_ready()
    assert triton_client.is_model_ready("attention") and triton_client.is_model_ready("attention", "1")
    server = triton_client.get_server_metadata()
    assert "binary_tensor_data" in server["extensions"] and server["name"]
    meta = triton_client.get_model_metadata("attention")
    assert meta["name"] == "attention" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "hidden_states", "datatype": "FP32", "shape": [-1, -1, 512]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, -1, 512]}]
    assert triton_client.get_model_metadata("attention", "1") == meta


@pytest.mark.parametrize("binary_in", [False, True], ids=["json-in", "binary-in"])
@pytest.mark.parametrize("binary_out", [False, True], ids=["json-out", "binary-out"])
def test_fp32_inference_matches_dense_reference(
    triton_client: triton.InferenceServerClient, binary_in: bool, binary_out: bool
) -> None:
    x = rand(2, 5, 512, seed=int(binary_in) * 2 + int(binary_out))
    result = triton_client.infer(
        "attention", [triton_input(x, "FP32", binary_in)],
        outputs=[triton.InferRequestedOutput("output", binary_data=binary_out)], request_id="req-7",
    )
    out = result.as_numpy("output")
    assert out.dtype == np.float32 and out.shape == (2, 5, 512)
    assert relative_error(torch.from_numpy(out.copy()), reference(x)) < 1e-5
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_name"] == "attention"
    tensor = result.get_output("output")
    assert tensor["datatype"] == "FP32" and tensor["shape"] == [2, 5, 512]
    assert ("binary_data_size" in tensor.get("parameters", {})) == binary_out


def test_default_outputs_versioned_route_2d_input_and_gzip(triton_client: triton.InferenceServerClient) -> None:
    """No outputs listed -> tritonclient asks binary_data_output; [seq, E] in -> [seq, E] out."""
    x = rand(7, 512, seed=11)
    result = triton_client.infer("attention", [triton_input(x, "FP32", True)], model_version="1",
                                 request_compression_algorithm="gzip")
    out = result.as_numpy("output")
    assert out.shape == (7, 512)
    assert relative_error(torch.from_numpy(out.copy()), reference(x)) < 1e-5


@pytest.mark.parametrize("datatype, np_dtype", [("FP16", np.float16), ("BF16", ml_dtypes.bfloat16)])
def test_half_precision_inputs(triton_client: triton.InferenceServerClient, datatype: str, np_dtype: type) -> None:
    """Half inputs are computed in float32; the reply keeps the input datatype unless output_dtype says."""
    x = (rand(2, 3, 512, seed=5) * 0.5).astype(np_dtype)
    want = reference(x.astype(np.float32))  # float32 compute of exactly the values sent
    result = triton_client.infer("attention", [triton_input(x, datatype, True)])
    out = result.as_numpy("output")
    assert result.get_output("output")["datatype"] == datatype and out.dtype == np.dtype(np_dtype)
    # The seed weights make outputs large (fp16 overflows to inf there): compare in the
    # reply dtype, where the server's float32 -> half rounding must equal torch's.
    want_half = want.to(torch.float16 if datatype == "FP16" else torch.bfloat16).float().numpy()
    np.testing.assert_allclose(out.astype(np.float32), want_half, rtol=1e-2)
    result = triton_client.infer("attention", [triton_input(x, datatype, True)],
                                 query_params={"output_dtype": "float32"})
    out32 = result.as_numpy("output")
    assert out32.dtype == np.float32 and relative_error(torch.from_numpy(out32.copy()), want) < 1e-5
    if datatype == "FP16":  # tritonclient sends FP16 as JSON too (BF16 only binary)
        result = triton_client.infer("attention", [triton_input(x, datatype, False)],
                                     outputs=[triton.InferRequestedOutput("output", binary_data=False)],
                                     query_params={"output_dtype": "float32"})
        assert relative_error(torch.from_numpy(result.as_numpy("output").copy()), want) < 1e-5


def test_client_errors_carry_the_server_message(triton_client: triton.InferenceServerClient) -> None:
    x = rand(1, 3, 256)
    with pytest.raises(InferenceServerException) as info:
        triton_client.infer("attention", [triton_input(x, "FP32", True)])
    assert info.value.status() == "422" and "embed_dim=512" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        triton_client.infer("attention", [triton_input(rand(1, 2, 512), "FP32", True)], model_version="2")
    assert info.value.status() == "404" and "version" in info.value.message()
    assert not triton_client.is_model_ready("nope")


def _header(inputs: list[dict], **extra: object) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _fp32_input(shape: list[int], **params: object) -> dict:
    return {"name": "hidden_states", "shape": shape, "datatype": "FP32", "parameters": params}


def _bad_oip_requests() -> list[tuple[str, dict, bytes, int]]:
    raw = rand(1, 2, 512).tobytes()
    nan = np.full((1, 2, 512), np.nan, np.float32).tobytes()
    good_header = _header([_fp32_input([1, 2, 512], binary_data_size=len(raw))])
    json_header = _header([{**_fp32_input([1, 512]), "data": [0.0] * 512}])
    hl = "Inference-Header-Content-Length"
    return [
        ("malformed JSON", {}, b'{"inputs": [', 400),
        ("not a request", {}, b'{"x": 1}', 400),
        ("empty body", {}, b"", 400),
        ("header length past the body", {hl: "99999"}, good_header + raw, 400),
        ("header length not an integer", {hl: "ten"}, good_header + raw, 422),
        ("binary size mismatch", {hl: str(len(good_header))}, good_header + raw[:-4], 400),
        ("bytes but no binary input", {hl: str(len(json_header))}, json_header + raw, 400),
        ("wrong input name", {}, _header([{**_fp32_input([1, 512]), "name": "x", "data": [0.0] * 512}]), 422),
        ("two inputs", {}, _header([{**_fp32_input([1, 512]), "data": [0.0] * 512}] * 2), 422),
        ("integer datatype", {}, _header([{**_fp32_input([1, 512]), "datatype": "INT32", "data": [0] * 512}]), 422),
        ("strings as data", {}, _header([{**_fp32_input([1, 512]), "data": ["a"] * 512}]), 422),
        ("data count mismatch", {}, _header([{**_fp32_input([1, 512]), "data": [0.0] * 511}]), 422),
        ("wrong embed dim", {}, _header([{**_fp32_input([1, 3]), "data": [0.0] * 3}]), 422),
        ("4-D shape", {}, _header([{**_fp32_input([1, 1, 1, 512]), "data": [0.0] * 512}]), 422),
        ("free dim in request", {}, _header([{**_fp32_input([-1, 512]), "data": [0.0] * 512}]), 422),
        ("NaN binary", {hl: str(len(good_header))}, good_header + nan, 422),
        # No data at all: the shape alone is refused before anything is decoded or computed.
        ("overlong sequence", {}, _header([_fp32_input([1, 16384, 512])]), 422),
        ("too many tokens", {}, _header([_fp32_input([128, 4096, 512])]), 422),
        ("unknown output", {}, _header([{**_fp32_input([1, 512]), "data": [0.0] * 512}], outputs=[{"name": "y"}]), 422),
        ("shared memory", {}, _header([_fp32_input([1, 512], shared_memory_region="r", shared_memory_byte_size=4)]), 400),
        ("unsupported media type", {"content-type": "text/plain"}, good_header, 415),
        ("unsupported encoding", {"content-encoding": "br"}, good_header, 415),
        ("bad gzip", {"content-encoding": "gzip"}, b"not gzip", 400),
    ]


@pytest.mark.parametrize("case", _bad_oip_requests(), ids=lambda c: c[0])
def test_bad_oip_request_gets_json_error_and_service_stays_healthy(app_url: str, case: tuple) -> None:
    _, headers, body, status = case
    r = httpx.post(app_url + INFER, content=body, headers=headers, timeout=60)
    assert r.status_code == status, (r.status_code, r.text)
    assert isinstance(r.json().get("error"), str) and r.json()["error"]
    x = rand(1, 3, 512, seed=9)
    ok = httpx.post(app_url + INFER, json={"inputs": [{**_fp32_input([1, 3, 512]), "data": x.ravel().tolist()}]},
                    timeout=60)
    assert ok.status_code == 200, ok.text
    out = np.asarray(ok.json()["outputs"][0]["data"], dtype=np.float32).reshape(1, 3, 512)
    assert relative_error(torch.from_numpy(out), reference(x)) < 1e-5


def test_oip_body_limit_is_refused_before_it_is_read(app_url: str) -> None:
    r = httpx.post(app_url + INFER, content=b"\0" * (64 * 1024 * 1024 + 1), timeout=60)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]


def test_nested_json_data_and_output_dtype(app_url: str) -> None:
    """The spec allows nested `data`; output_dtype=bfloat16 answers BF16."""
    x = rand(2, 2, 512, seed=4)
    r = httpx.post(app_url + INFER, params={"output_dtype": "bfloat16"},
                   json={"inputs": [{**_fp32_input([2, 2, 512]), "data": x.tolist()}]}, timeout=60)
    assert r.status_code == 200, r.text
    tensor = r.json()["outputs"][0]
    assert tensor["datatype"] == "BF16" and tensor["shape"] == [2, 2, 512]
    want = reference(x).to(torch.bfloat16).float().numpy().ravel()
    np.testing.assert_allclose(np.asarray(tensor["data"], np.float32), want, rtol=1e-2)
