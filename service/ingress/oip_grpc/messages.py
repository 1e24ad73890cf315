"""gRPC messages <-> the Open Inference Protocol's own model (service.ingress.oip).

A `ModelInferRequest` is parsed from its raw bytes here (so a malformed message is our 400
`malformed`, INVALID_ARGUMENT), turned into the same `InferenceRequest` an HTTP body becomes
(its parameters as plain values: bool, int, str, float), and its tensors decoded and checked by
the same code (service.ingress.oip.codec.check_inputs): the limits on shapes apply before any
value is converted, a raw input's bytes must be exactly its shape's, and every datatype HTTP
takes is taken. Tensor data comes as `raw_input_contents` (one entry per input, in input
order, little-endian row-major bytes: what tritonclient.grpc sends) or as the input's typed
`contents` (FP32 `fp32_contents`, FP64 `fp64_contents`; the mask's BOOL `bool_contents`,
UINT8 `uint_contents`, INT32 `int_contents`, INT64 `int64_contents`; FP16 and BF16 have no
typed field in the protocol). The output goes back as `raw_output_contents`.

Pure functions of their arguments: they run on the event loop for small messages and in the
ingress's DecodePool otherwise (service.ingress.oip_grpc.service).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from service.contract.errors import BadRequest, NotFound, PayloadTooLarge
from service.ingress import codecs
from service.ingress.oip.codec import CheckedInputs, binary_outputs, check_inputs, request_of
from service.ingress.oip.inference import Answer
from service.ingress.oip.routes import check_version
from service.ingress.oip.schemas import MODEL_NAME, MODEL_VERSION, InferenceRequest
from service.ingress.oip_grpc import gangserve_inference_pb2 as pb

# The request parameter naming the output's dtype (HTTP: the output_dtype query parameter).
OUTPUT_DTYPE_PARAMETER = "output_dtype"
# Each datatype's typed contents field (the protocol's; FP16 and BF16 have none).
TYPED_FIELDS: dict[str, str] = {
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BOOL": "bool_contents", "UINT8": "uint_contents",
    "INT32": "int_contents", "INT64": "int64_contents",
}


@dataclass(frozen=True)
class DecodedRequest:
    """A ModelInferRequest as the protocol's model and its checked input tensors."""

    request: InferenceRequest
    inputs: CheckedInputs


def parse(raw: bytes, message: type[Any], max_bytes: int) -> Any:
    """`raw` as a `message`; 413 over `max_bytes`, 400 `malformed` when it is not one."""
    if len(raw) > max_bytes:
        raise PayloadTooLarge(f"the message is {len(raw)} bytes; the limit is max_body_bytes={max_bytes}")
    try:
        return message.FromString(raw)
    except DecodeError as exc:
        raise BadRequest(f"the message is not a valid {message.DESCRIPTOR.full_name} ({len(raw)} bytes): "
                         f"{str(exc)[:200]}") from None


def check_model(name: str, version: str) -> None:
    """404 `not_found` unless `name` is the served model and `version` empty or its version."""
    if name != MODEL_NAME:
        raise NotFound(f"this server serves model {MODEL_NAME!r} only; got {name!r:.50}")
    if version:
        check_version(version)


def decode_infer(raw: bytes, limits: codecs.Limits, max_bytes: int) -> DecodedRequest:
    """A ModelInferRequest's bytes -> the checked request (every check HTTP's OIP makes)."""
    msg = parse(raw, pb.ModelInferRequest, max_bytes)
    check_model(msg.model_name, msg.model_version)
    req = request_of(_request_doc(msg))
    output_dtype = (req.parameters or {}).get(OUTPUT_DTYPE_PARAMETER)
    binary_outputs(req)  # the requested outputs' names and parameters, as HTTP checks them
    return DecodedRequest(req, check_inputs(req, _raw_inputs(msg), limits, output_dtype))


def _request_doc(msg: Any) -> dict[str, Any]:
    """The request as the document HTTP's JSON would be (typed contents as `data`)."""
    inputs = []
    for tensor in msg.inputs:
        spec: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                                "parameters": parameters_of(tensor.parameters) or None}
        if tensor.HasField("contents"):
            spec["data"] = _typed_data(tensor)
        inputs.append(spec)
    doc: dict[str, Any] = {"inputs": inputs, "parameters": parameters_of(msg.parameters) or None}
    if msg.id:
        doc["id"] = msg.id
    if msg.outputs:
        doc["outputs"] = [{"name": o.name, "parameters": parameters_of(o.parameters) or None} for o in msg.outputs]
    return doc


def _typed_data(tensor: Any) -> list[Any]:
    """An input's typed contents: the one field its datatype uses, as a flat list."""
    field = TYPED_FIELDS.get(tensor.datatype)
    used = [f.name for f, _ in tensor.contents.ListFields()]
    if field is None:
        raise BadRequest(f"input {tensor.name!r:.50}: datatype {tensor.datatype!r:.20} has no typed contents in the "
                         "protocol; send its bytes in raw_input_contents")
    others = [name for name in used if name != field]
    if others:
        raise BadRequest(f"input {tensor.name!r:.50} is {tensor.datatype}: its typed contents go in {field}; "
                         f"found {', '.join(others)}")
    return list(getattr(tensor.contents, field))


def _raw_inputs(msg: Any) -> list[bytes | None]:
    """Input i's raw bytes (raw_input_contents[i]) or None (its typed contents)."""
    raws = list(msg.raw_input_contents)
    if not raws:
        for tensor in msg.inputs:
            if not tensor.HasField("contents"):
                raise BadRequest(f"input {tensor.name!r:.50} has no data: neither raw_input_contents nor contents")
        return [None] * len(msg.inputs)
    if len(raws) != len(msg.inputs):
        raise BadRequest(f"the request has {len(msg.inputs)} inputs and {len(raws)} raw_input_contents; "
                         "raw contents need one entry per input, in input order")
    for tensor in msg.inputs:
        if tensor.HasField("contents"):
            raise BadRequest(f"input {tensor.name!r:.50} has both raw_input_contents and typed contents; send one")
    return raws


def parameters_of(params: Any) -> dict[str, Any]:
    """A protobuf parameters map as plain values (a parameter with no value set: None)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = None if which is None else getattr(value, which)
    return out


def set_parameter(param: Any, value: Any) -> None:
    """One InferParameter from a plain value (bool, int, float, str)."""
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)


def infer_response(req: InferenceRequest, answer: Answer) -> Any:
    """The ModelInferResponse: the output tensor as raw_output_contents, the request's id, and a
    sequence's parameters (sequence_id, sequence_length, weights_version)."""
    out = answer.output
    response = pb.ModelInferResponse(model_name=MODEL_NAME, model_version=MODEL_VERSION, id=req.id or "")
    response.outputs.add(name=codecs.OUTPUT_NAME, datatype=codecs.oip_datatype(out.dtype), shape=list(out.shape))
    response.raw_output_contents.append(bytes(codecs.raw_bytes(out)))
    for key, value in (answer.parameters or {}).items():
        if value is not None:
            set_parameter(response.parameters[key], value)
    return response


def failed_response(req_id: str | None) -> Any:
    """The infer_response a stream's error message carries: the failed request's id (if known)."""
    return pb.ModelInferResponse(model_name=MODEL_NAME, model_version=MODEL_VERSION, id=req_id or "")


def request_id_of(raw: bytes) -> str | None:
    """The id of a request whose decoding failed, when its bytes parse at all (for a stream's error)."""
    try:
        return pb.ModelInferRequest.FromString(raw).id or None
    except DecodeError:
        return None
