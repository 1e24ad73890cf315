"""The Open Inference Protocol over gRPC (service.ingress.oip_grpc) through the front door:
stock `tritonclient.grpc` on the Serve instance's gRPC port (HAProxy's gRPC frontend, straight
to the Ingress replica), the shared `make serve` app; every expected output comes from
tests.reference (torch.nn.MultiheadAttention with the notes' seed weights), never from the
code under test. Hostile messages are raw bytes on a plain gRPC channel.

The suite's Serve instance holds several applications at times, so each call names its
application in the `application` metadata (HAProxy routes by it); with one application, as
`make serve` runs, a client needs none.
"""
from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import uuid
from typing import Any, Iterator

import grpc
import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import yaml
from tritonclient.grpc import model_config_pb2 as triton_config_pb2
from tritonclient.grpc import service_pb2 as triton_pb2
from tritonclient.utils import InferenceServerException

from harness.local import ROOT
from service.cluster.front_door import DEFAULT_GRPC_PORT, grpc_options
from service.contract.errors import ErrorCode
from service.ingress.oip_grpc import gangserve_inference_pb2 as ours
from service.ingress.oip_grpc.status import CODE_METADATA, GRPC_BY_HTTP, grpc_status, with_status_table
from tests.helpers import eventually, rand, scrape, total
from tests.reference import reference, relative_error

APP = {"application": "gangserve"}  # the app_url fixture's application name
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


# ---------------------------------------------------------------- without Ray

@pytest.mark.unit
def test_the_committed_stubs_are_current() -> None:
    from service.ingress.oip_grpc import stubs

    assert stubs.main(["--check"]) == 0, "run `python -m service.ingress.oip_grpc.stubs`"


def _fields(message: Any) -> dict[str, tuple[int, int, bool, str]]:
    return {f.name: (f.number, f.type, f.is_repeated, f.message_type.name if f.message_type else "")
            for f in message.fields}


def _walk(message: Any) -> Iterator[Any]:
    yield message
    for nested in message.nested_types:
        yield from _walk(nested)


@pytest.mark.unit
def test_every_message_and_method_is_on_tritons_wire() -> None:
    """Each field of our .proto has the number, type and cardinality of the same field in the
    installed tritonclient's own descriptors (what a stock client encodes and decodes)."""
    theirs_files = (triton_pb2.DESCRIPTOR, triton_config_pb2.DESCRIPTOR)
    for top in ours.DESCRIPTOR.message_types_by_name.values():
        for message in _walk(top):
            theirs = next(f.pool.FindMessageTypeByName(message.full_name) for f in theirs_files)
            mine, wire = _fields(message), _fields(theirs)
            for name, spec in mine.items():
                assert wire.get(name) == spec, (message.full_name, name, spec, wire.get(name))
    mine_service = ours.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs_service = triton_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert mine_service.full_name == theirs_service.full_name == "inference.GRPCInferenceService"
    for method in mine_service.methods:
        twin = theirs_service.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name, method.client_streaming,
                method.server_streaming) == (twin.input_type.full_name, twin.output_type.full_name,
                                             twin.client_streaming, twin.server_streaming), method.name
    for enum in ("DataType",):
        mine_values = {v.name: v.number for v in ours.DESCRIPTOR.enum_types_by_name[enum].values}
        theirs_values = {v.name: v.number for v in triton_config_pb2.DESCRIPTOR.enum_types_by_name[enum].values}
        assert mine_values.items() <= theirs_values.items()


@pytest.mark.unit
def test_every_error_code_has_one_grpc_status_of_its_class() -> None:
    allowed_4xx = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED}
    for code in ErrorCode:
        status = grpc_status(code)
        if 400 <= code.status < 500:
            assert status in allowed_4xx, (code, status)
        elif code.status == 503:
            assert status == grpc.StatusCode.UNAVAILABLE, code
        elif code.status == 504:
            assert status == grpc.StatusCode.DEADLINE_EXCEEDED, code
    assert set(GRPC_BY_HTTP) >= {c.status for c in ErrorCode}


@pytest.mark.unit
def test_the_api_docs_grpc_table_is_current() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    assert with_status_table(text) == text, "docs/api.md's gRPC status table is stale: run `make docs`"


@pytest.mark.unit
def test_every_serve_config_and_the_image_open_the_grpc_port() -> None:
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    from service.ingress.oip_grpc.servicer import add_GRPCInferenceServiceServicer_to_server

    for name in ("local.yaml", "cpu.yaml", "gpu.yaml", "gpu-1.yaml"):
        doc = yaml.safe_load((ROOT / "deployments" / name).read_text())
        assert doc.get("grpc_options") == grpc_options(DEFAULT_GRPC_PORT), name
        # What `serve run` and service.launch make of it: Serve imports our servicer function.
        options = gRPCOptions(**ServeDeploySchema.model_validate(doc).grpc_options.model_dump())
        assert options.grpc_servicer_func_callable == [add_GRPCInferenceServiceServicer_to_server], name
    docs = [d for d in yaml.safe_load_all((ROOT / "deployments" / "kuberay.yaml").read_text()) if d]
    service = next(d for d in docs if d.get("kind") == "RayService")
    assert yaml.safe_load(service["spec"]["serveConfigV2"])["grpc_options"] == grpc_options(DEFAULT_GRPC_PORT)
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert DEFAULT_GRPC_PORT in [p["containerPort"] for p in head["ports"]]
    policy = next(d for d in docs if d.get("kind") == "NetworkPolicy")
    assert any(not rule.get("from") and DEFAULT_GRPC_PORT in [p.get("port") for p in rule.get("ports", [])]
               for rule in policy["spec"]["ingress"]), "the NetworkPolicy does not admit the gRPC port"
    assert re.search(rf"^EXPOSE .*\b{DEFAULT_GRPC_PORT}\b", (ROOT / "Dockerfile").read_text(), re.M)


# ---------------------------------------------------------------- through the front door

@pytest.fixture(scope="module")
def target(app_url: str, serve_grpc_port: int) -> str:
    return f"127.0.0.1:{serve_grpc_port}"


# gRPC's own client-side retry of UNAVAILABLE (a stock channel option, as any client behind a
# load balancer sets): HAProxy answers UNAVAILABLE itself for the moment it holds no healthy
# server for the app (its health checks, a reload when the suite deploys or deletes other apps).
RETRY_UNAVAILABLE = [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps({"methodConfig": [{
    "name": [{"service": "inference.GRPCInferenceService"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "2s", "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"]}}]}))]


@pytest.fixture(scope="module")
def client(target: str) -> Iterator[tgrpc.InferenceServerClient]:
    c = tgrpc.InferenceServerClient(target, channel_args=[("grpc.max_send_message_length", -1),
                                                          ("grpc.max_receive_message_length", -1), *RETRY_UNAVAILABLE])
    yield c
    c.close()


@pytest.fixture(scope="module")
def channel(target: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1),
                                                ("grpc.max_receive_message_length", -1), *RETRY_UNAVAILABLE]) as ch:
        yield ch


def _input(x: np.ndarray, datatype: str, name: str = "hidden_states") -> tgrpc.InferInput:
    return tgrpc.InferInput(name, list(x.shape), datatype).set_data_from_numpy(x)


def _rows(result: tgrpc.InferResult) -> torch.Tensor:
    return torch.from_numpy(result.as_numpy("output").astype(np.float32))


@pytest.mark.ray
def test_the_grpc_port_is_haproxy(target: str) -> None:
    port = target.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    assert set(re.findall(r'users:\(\("([^"]+)"', out)) == {"haproxy"}, out


@pytest.mark.ray
def test_health_metadata_and_config(client: tgrpc.InferenceServerClient) -> None:
    assert client.is_server_live(headers=APP) and client.is_server_ready(headers=APP)
    assert client.is_model_ready("attention", headers=APP) and client.is_model_ready("attention", "1", headers=APP)
    assert not client.is_model_ready("nope", headers=APP)
    meta = client.get_model_metadata("attention", headers=APP, as_json=True)
    assert meta["name"] == "attention" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "hidden_states", "datatype": "FP32", "shape": ["-1", "-1", "512"]}]
    config = client.get_model_config("attention", headers=APP, as_json=True)["config"]
    assert config["name"] == "attention" and config["input"][0]["data_type"] == "TYPE_FP32"
    assert client.get_server_metadata(headers=APP).name == "gangserve"
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("attention", "2", headers=APP)
    assert info.value.status() == "StatusCode.NOT_FOUND" and "[not_found]" in info.value.message()
    with pytest.raises(InferenceServerException) as info:  # not served: gRPC's own UNIMPLEMENTED
        client.get_inference_statistics(headers=APP)
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"


@pytest.mark.ray
@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
def test_inference_matches_the_dense_reference(client: tgrpc.InferenceServerClient, datatype: str) -> None:
    np_dtype = {"FP32": np.float32, "FP16": np.float16, "BF16": ml_dtypes.bfloat16}[datatype]
    x = (rand(2, 5, 512, seed=31) * 0.5).astype(np_dtype)
    want = reference(x.astype(np.float32))  # float32 compute of exactly the values sent
    result = client.infer("attention", [_input(x, datatype)], request_id="g-7", headers=APP)
    assert result.get_response().id == "g-7" and result.get_output("output").datatype == datatype
    out = result.as_numpy("output")
    assert out.dtype == np.dtype(np_dtype) and out.shape == (2, 5, 512)
    if datatype == "FP32":
        assert relative_error(_rows(result), want) < 1e-5
    else:  # compared in the reply's dtype: the server's float32 -> half rounding equals torch's
        half = want.to(torch.float16 if datatype == "FP16" else torch.bfloat16).float().numpy()
        np.testing.assert_allclose(out.astype(np.float32), half, rtol=1e-2)
        exact = client.infer("attention", [_input(x, datatype)], parameters={"output_dtype": "float32"}, headers=APP)
        assert exact.as_numpy("output").dtype == np.float32 and relative_error(_rows(exact), want) < 1e-5


@pytest.mark.ray
def test_mask_causal_and_typed_contents(client: tgrpc.InferenceServerClient, channel: grpc.Channel) -> None:
    x = rand(2, 6, 512, seed=32)
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=np.int64)
    result = client.infer("attention", [_input(x, "FP32"), _input(mask, "INT64", "attention_mask")],
                          parameters={"causal": True}, headers=APP)
    want = reference(x, mask, causal=True)
    keep = torch.from_numpy(mask.astype(bool))
    assert relative_error(_rows(result)[keep], want[keep]) < 1e-5
    # Typed contents (fp32_contents, the mask in bool_contents), in tritonclient's own messages.
    request = triton_pb2.ModelInferRequest(model_name="attention", id="typed")
    request.inputs.add(name="hidden_states", datatype="FP32", shape=[2, 6, 512]).contents.fp32_contents.extend(
        x.ravel().tolist())
    request.inputs.add(name="attention_mask", datatype="BOOL", shape=[2, 6]).contents.bool_contents.extend(
        mask.astype(bool).ravel().tolist())
    reply = triton_pb2.ModelInferResponse.FromString(
        channel.unary_unary(INFER)(request.SerializeToString(), metadata=tuple(APP.items()), timeout=60))
    got = torch.from_numpy(np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(2, 6, 512).copy())
    assert reply.id == "typed" and relative_error(got[keep], reference(x, mask)[keep]) < 1e-5


@pytest.mark.ray
def test_a_sequence_of_one_row_appends_is_the_causal_reference(client: tgrpc.InferenceServerClient) -> None:
    rows = rand(5, 512, seed=33)
    sequence = uuid.uuid4().int % (1 << 62) + 1  # an int64 sequence_id, new each run
    for i in range(len(rows)):
        key = f"append-{sequence}-{i}"
        result = client.infer("attention", [_input(rows[i:i + 1], "FP32")], sequence_id=sequence,
                              sequence_start=i == 0, sequence_end=i == len(rows) - 1,
                              parameters={"idempotency_key": key}, headers=APP)
        want = reference(rows[:i + 1], causal=True)[-1:]
        assert relative_error(_rows(result), want) < 1e-5, i
        params = result.get_response().parameters
        assert params["sequence_length"].int64_param == i + 1 and params["sequence_id"].int64_param == sequence
        if i == 2:  # a retry with the same key: the same answer, nothing appended
            again = client.infer("attention", [_input(rows[i:i + 1], "FP32")], sequence_id=sequence,
                                 parameters={"idempotency_key": key}, headers=APP)
            assert np.array_equal(again.as_numpy("output"), result.as_numpy("output"))
            assert again.get_response().parameters["sequence_length"].int64_param == i + 1
    with pytest.raises(InferenceServerException) as info:  # sequence_end ended it
        client.infer("attention", [_input(rows[:1], "FP32")], sequence_id=sequence, headers=APP)
    assert info.value.status() == "StatusCode.NOT_FOUND" and "[session_not_found]" in info.value.message()


@pytest.mark.ray
def test_a_stream_answers_in_order_with_errors_in_error_message(client: tgrpc.InferenceServerClient) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    x, rows = rand(1, 4, 512, seed=34), rand(3, 512, seed=35)
    sequence = f"stream-{uuid.uuid4().hex}"  # a string sequence_id
    client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=APP)
    try:
        client.async_stream_infer("attention", [_input(x, "FP32")], request_id="plain")
        for i in range(len(rows)):
            client.async_stream_infer("attention", [_input(rows[i:i + 1], "FP32")], request_id=f"row-{i}",
                                      sequence_id=sequence, sequence_start=i == 0, sequence_end=i == len(rows) - 1)
        client.async_stream_infer("attention", [_input(rand(1, 2, 256), "FP32")], request_id="bad")
        client.async_stream_infer("attention", [_input(x, "FP32")], request_id="last")
        got = [answers.get(timeout=120) for _ in range(6)]
    finally:
        client.stop_stream()
    ids = [result.get_response().id if result is not None else "error" for result, _ in got]
    assert ids == ["plain", "row-0", "row-1", "row-2", "error", "last"]
    assert relative_error(_rows(got[0][0]), reference(x)) < 1e-5
    for i in range(len(rows)):
        assert relative_error(_rows(got[1 + i][0]), reference(rows[:i + 1], causal=True)[-1:]) < 1e-5
    error = got[4][1]
    assert isinstance(error, InferenceServerException) and error.message().startswith("[invalid_input]")
    assert "512" in error.message()
    assert relative_error(_rows(got[5][0]), reference(x)) < 1e-5


def _grpc_requests(app_url: str, code: str) -> float:
    return total(scrape(app_url), "gangserve_requests_total", protocol="grpc", route=INFER, format="protobuf",
                 code=code)


@pytest.mark.ray
def test_deadlines_are_deadline_exceeded(app_url: str, client: tgrpc.InferenceServerClient) -> None:
    before = _grpc_requests(app_url, "504")
    x = rand(64, 128, 512, seed=36)  # ~0.1-0.5 s of compute on this machine
    with pytest.raises(InferenceServerException) as info:  # the `timeout` parameter: microseconds
        client.infer("attention", [_input(x, "FP32")], timeout=20_000, headers=APP)
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert info.value.message().startswith("[deadline_exceeded]"), info.value.message()
    eventually(lambda: _grpc_requests(app_url, "504") >= before + 1, 30, "the ingress counted its 504")
    # The call's own gRPC deadline: whoever answers first (the ingress a margin before it, or the
    # client's own timer; under load the call may not even reach the ingress in time), the
    # client gets DEADLINE_EXCEEDED, and the service goes on serving.
    with pytest.raises(InferenceServerException) as info:
        client.infer("attention", [_input(x, "FP32")], client_timeout=0.05, headers=APP)
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert client.is_server_ready(headers=APP)


@pytest.mark.unit
def test_the_ingress_reads_the_calls_grpc_deadline() -> None:
    """The deadline Serve's RayServegRPCContext leaves out reaches the Ingress's methods
    (service.cluster.front_door.carry_grpc_deadlines), measured on a real gRPC call."""
    import asyncio
    import time as clock

    from ray.serve.grpc_util import RayServegRPCContext

    from service.cluster.front_door import carry_grpc_deadlines, grpc_deadline

    assert carry_grpc_deadlines() and carry_grpc_deadlines()  # idempotent
    seen: dict[str, float | None] = {}

    async def handler(request: bytes, context: Any) -> bytes:
        seen["left"] = (grpc_deadline(RayServegRPCContext(context)) or 0.0) - clock.monotonic()
        seen["none"] = grpc_deadline(object())
        return request

    async def call() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "t.S", {"M": grpc.unary_unary_rpc_method_handler(handler)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                assert await ch.unary_unary("/t.S/M")(b"x", timeout=30.0) == b"x"
        finally:
            await server.stop(0)

    asyncio.run(call())
    # gRPC measures time_remaining() against its own cached clock, which may lag this process's
    # monotonic clock by a scheduler tick or more under load (30.099 s seen in CI): a 0.5 s margin.
    assert 20.0 < seen["left"] <= 30.5 and seen["none"] is None  # type: ignore[operator]


@pytest.mark.ray
def test_grpc_calls_are_counted_like_http_ones(app_url: str, client: tgrpc.InferenceServerClient,
                                               channel: grpc.Channel) -> None:
    ok, bad = _grpc_requests(app_url, "200"), _grpc_requests(app_url, "400")
    for _ in range(2):
        _assert_serves(client)
    with pytest.raises(grpc.RpcError):
        channel.unary_unary(INFER)(b"\xff\xff", metadata=tuple(APP.items()), timeout=60)
    assert _grpc_requests(app_url, "200") == ok + 2 and _grpc_requests(app_url, "400") == bad + 1


def _tensor_request(shape: list[int], datatype: str = "FP32", raw: bytes | None = None, **fields: Any) -> bytes:
    request = triton_pb2.ModelInferRequest(model_name=fields.pop("model_name", "attention"), **fields)
    request.inputs.add(name="hidden_states", datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.append(raw)
    return request.SerializeToString()


def _typed_fp16() -> bytes:
    request = triton_pb2.ModelInferRequest(model_name="attention")
    request.inputs.add(name="hidden_states", datatype="FP16", shape=[1, 512]).contents.fp32_contents.extend([0.0] * 512)
    return request.SerializeToString()


_ROW = rand(1, 2, 512, seed=37)
HOSTILE = [  # (what, message bytes, gRPC status, our code)
    ("malformed protobuf", b"\xff\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
    ("a truncated message", _tensor_request([1, 2, 512], raw=_ROW.tobytes())[:-7],
     grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
    ("a shape that lies about its bytes", _tensor_request([1, 4, 512], raw=_ROW.tobytes()),
     grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
    ("a 2 GiB claim", _tensor_request([1, 1 << 20, 512], raw=b"\0" * 8), grpc.StatusCode.INVALID_ARGUMENT,
     "invalid_input"),
    ("a 2^62-element claim", _tensor_request([1 << 31, 1 << 31, 512], raw=b"\0" * 8),
     grpc.StatusCode.INVALID_ARGUMENT, "invalid_input"),
    ("an unknown dtype", _tensor_request([1, 2, 512], "FP8", raw=_ROW.tobytes()), grpc.StatusCode.INVALID_ARGUMENT,
     "invalid_input"),
    ("BYTES", _tensor_request([1, 2, 512], "BYTES", raw=_ROW.tobytes()), grpc.StatusCode.INVALID_ARGUMENT,
     "invalid_input"),
    ("no data", _tensor_request([1, 2, 512]), grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
    ("two raw contents for one input", _tensor_request([1, 2, 512], raw=_ROW.tobytes(),
                                                        raw_input_contents=[b"x"]),
     grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
    ("FP16 in typed contents", _typed_fp16(), grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
    ("NaN", _tensor_request([1, 2, 512], raw=np.full((1, 2, 512), np.nan, np.float32).tobytes()),
     grpc.StatusCode.INVALID_ARGUMENT, "invalid_input"),
    ("another model", _tensor_request([1, 2, 512], raw=_ROW.tobytes(), model_name="bert"),
     grpc.StatusCode.NOT_FOUND, "not_found"),
    ("a non-boolean causal", triton_pb2.ModelInferRequest(
        model_name="attention", parameters={"causal": triton_pb2.InferParameter(string_param="yes")},
        inputs=[triton_pb2.ModelInferRequest.InferInputTensor(name="hidden_states", datatype="FP32", shape=[1, 2, 512])],
        raw_input_contents=[_ROW.tobytes()]).SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT, "invalid_input"),
    ("a timeout that is not one", _tensor_request([1, 2, 512], raw=_ROW.tobytes(), parameters={
        "timeout": triton_pb2.InferParameter(int64_param=-5)}), grpc.StatusCode.INVALID_ARGUMENT, "invalid_deadline"),
]


def _assert_serves(client: tgrpc.InferenceServerClient) -> None:
    x = rand(1, 3, 512, seed=38)
    result = client.infer("attention", [_input(x, "FP32")], headers=APP)
    assert relative_error(_rows(result), reference(x)) < 1e-5


@pytest.mark.ray
@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_messages_get_a_clear_status_and_the_service_stays_healthy(
    client: tgrpc.InferenceServerClient, channel: grpc.Channel, case: tuple[str, bytes, grpc.StatusCode, str]
) -> None:
    _, body, status, code = case
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(INFER)(body, metadata=tuple(APP.items()), timeout=60)
    error = info.value
    assert error.code() == status, (error.code(), error.details())
    assert error.details().startswith(f"[{code}] ") and len(error.details()) > len(code) + 5
    assert dict(error.trailing_metadata())[CODE_METADATA] == code
    _assert_serves(client)


@pytest.mark.ray
def test_a_message_over_max_body_bytes_is_refused_from_its_length(
    client: tgrpc.InferenceServerClient, channel: grpc.Channel
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(INFER)(b"\0" * (64 * 1024 * 1024 + 1), metadata=tuple(APP.items()), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    _assert_serves(client)


@pytest.mark.ray
def test_a_malformed_stream_message_is_its_error_message(channel: grpc.Channel) -> None:
    good = _tensor_request([1, 2, 512], raw=_ROW.tobytes(), id="good")
    replies = list(channel.stream_stream(STREAM)(iter([b"\xff\xff", good]), metadata=tuple(APP.items()), timeout=60))
    first, second = (triton_pb2.ModelStreamInferResponse.FromString(r) for r in replies)
    assert first.error_message.startswith("[malformed] ")
    assert not second.error_message and second.infer_response.id == "good"
    got = np.frombuffer(second.infer_response.raw_output_contents[0], np.float32).reshape(1, 2, 512)
    assert relative_error(torch.from_numpy(got.copy()), reference(_ROW)) < 1e-5


# ---------------------------------------------------------------- the inference token

_AUTH_SERVER = r'''
import asyncio, os, sys
import grpc
from service.app import parse_args
from service.ingress.deps import DecodePool
from service.ingress.oip_grpc.service import OipGrpc, Tokens
from service.ingress.oip_grpc.servicer import add_GRPCInferenceServiceServicer_to_server
from harness.local import local_yaml_args

class Servicer:  # the Ingress's gRPC methods, on a plain gRPC server: no gang behind it
    def __init__(self, oip):
        self.oip = oip
    def __getattr__(self, name):
        method = {"ServerLive": "server_live", "ServerReady": "server_ready", "ModelReady": "model_ready",
                  "ServerMetadata": "server_metadata", "ModelMetadata": "model_metadata",
                  "ModelConfig": "model_config", "ModelInfer": "model_infer",
                  "ModelStreamInfer": "model_stream_infer"}[name]
        return getattr(self.oip, method)

async def main():
    cfg = parse_args(local_yaml_args())
    oip = OipGrpc(cfg, None, None, DecodePool(1, 4), Tokens(api=sys.argv[1], infer=sys.argv[2]))
    server = grpc.aio.server()
    add_GRPCInferenceServiceServicer_to_server(Servicer(oip), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    await server.stop(0)

asyncio.run(main())
'''


@pytest.mark.unit
def test_inference_needs_the_inference_token_when_set() -> None:
    """The Ingress's gRPC service (its real OipGrpc and servicer registration, no gang behind
    it: the call fails after auth, as test_auth's HTTP matrix does) with both tokens set."""
    api, infer = "api-token-0123456789", "infer-token-0123456789"
    server = subprocess.Popen([sys.executable, "-c", _AUTH_SERVER, api, infer], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        c = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
        x = [_input(rand(1, 2, 512), "FP32")]
        for headers, code in ((None, "missing_token"), ({"authorization": "Basic abc"}, "missing_token"),
                              ({"authorization": "Bearer wrong"}, "invalid_token")):
            with pytest.raises(InferenceServerException) as info:
                c.infer("attention", x, headers=headers)
            assert info.value.status() == "StatusCode.UNAUTHENTICATED"
            assert info.value.message().startswith(f"[{code}]"), info.value.message()
        for token in (infer, api):  # past auth: the missing gang fails it, never UNAUTHENTICATED
            with pytest.raises(InferenceServerException) as info:
                c.infer("attention", x, headers={"authorization": f"Bearer {token}"})
            assert info.value.status() == "StatusCode.INTERNAL" and info.value.message().startswith("[internal]")
        refused: queue.Queue[Any] = queue.Queue()
        c.start_stream(callback=lambda result, error: refused.put(error))
        try:
            c.async_stream_infer("attention", x)
        except InferenceServerException:
            pass  # the server ended the stream before this request went: the error is the callback's
        assert refused.get(timeout=30).status() == "StatusCode.UNAUTHENTICATED"
        c.stop_stream()
        assert c.is_server_live() and c.get_model_metadata("attention").name == "attention"  # open, as HTTP's
        c.close()
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=30)
