"""OIP v2 bodies: a request body -> checked tensors, the output tensor -> the reply.

Shapes and limits are checked before any tensor data is decoded. Pure functions of their
arguments (no request, no app state): they run on the event loop for small bodies and in
the DecodePool otherwise (service.ingress.oip.routes).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import orjson
from fastapi import Response
from gangserve_client import codecs as wire
from pydantic import ValidationError

from service.contract.errors import BadRequest, InvalidInput, PayloadTooLarge, UnsupportedMediaType, describe_validation_errors
from service.ingress import codecs
from service.ingress.oip.schemas import (
    BINARY_MEDIA, HEADER_LENGTH, MAX_PARAMETERS, MAX_TENSORS, MODEL_NAME, MODEL_VERSION, InferenceRequest, RequestInput,
)


@dataclass(frozen=True)
class CheckedInputs:
    """A request's input tensors, decoded and checked: what both protocols hand the gang."""

    x: np.ndarray  # [batch, seq, E] float32
    mask: np.ndarray | None  # [batch, seq] bool, True = token (None: no attention_mask input)
    squeezed: bool  # the input was [seq, E]: the reply is too
    reply_dtype: np.dtype  # the output's dtype (the input's, unless output_dtype says)


def prepare(
    body: bytes, encoding: str, cap: tuple[int, str], header_length: int | None, limits: codecs.Limits,
    output_dtype: str | None,
) -> tuple[InferenceRequest, np.ndarray, np.ndarray | None, bool, np.dtype, bool]:
    """Inflate (capped), parse and check an HTTP request, and decode its input tensors:
    (request, then CheckedInputs' x, mask, squeezed and reply dtype, then binary output)."""
    body = _decompress(body, encoding, *cap)
    if not body:
        raise BadRequest("request body is empty; it needs a JSON inference request")
    view = memoryview(body)
    if header_length is None:
        header_length = len(view)
    elif header_length > len(view):
        raise BadRequest(f"{HEADER_LENGTH} is {header_length}; the body has only {len(view)} bytes")
    req = _parse_request(view[:header_length], limits)
    inputs = check_inputs(req, _binary_slices(req, view[header_length:]), limits, output_dtype)
    return req, inputs.x, inputs.mask, inputs.squeezed, inputs.reply_dtype, binary_outputs(req)


def check_inputs(req: InferenceRequest, raws: Sequence[memoryview | bytes | None], limits: codecs.Limits,
                 output_dtype: str | None) -> CheckedInputs:
    """The request's inputs decoded (`raws[i]`: input i's binary bytes, None: its `data`) and
    checked: shapes against `limits` before any value is converted, the mask against the input."""
    array, raw_mask, squeezed = _decode_input(req, raws, limits)
    reply_dtype = codecs.reply_dtype(array.dtype, output_dtype)
    x = codecs.to_model_input(array)
    mask = codecs.validate_attention_mask(raw_mask, x.shape, squeezed)
    return CheckedInputs(x, mask, squeezed, reply_dtype)


def _parse_request(header: memoryview, limits: codecs.Limits) -> InferenceRequest:
    return request_of(codecs.loads_json(header, limits, what="inference request"))


def request_of(doc: Any) -> InferenceRequest:
    """A parsed request document (JSON's, or one built from a protobuf message) as the
    protocol's model: its lists and maps bounded first, then validated (400 when it is not one)."""
    _check_sizes(doc)
    try:
        return InferenceRequest.model_validate(doc)
    except ValidationError as exc:
        raise BadRequest(f"invalid inference request: {describe_validation_errors(exc.errors())}") from None


def _check_sizes(doc: Any) -> None:
    """Bound the lists and maps pydantic would walk (tensors, shapes, parameters), cheaply."""
    if not isinstance(doc, dict):
        return
    maps = [doc.get("parameters")]
    for key in ("inputs", "outputs"):
        tensors = doc.get(key)
        if not isinstance(tensors, list):
            continue
        if len(tensors) > MAX_TENSORS:
            raise InvalidInput(f"the request has {len(tensors)} {key}; model {MODEL_NAME!r} takes at most {MAX_TENSORS}")
        for tensor in tensors:
            if isinstance(tensor, dict):
                shape = tensor.get("shape")
                if isinstance(shape, list) and len(shape) > wire.MAX_DIMS:
                    raise InvalidInput(f"a shape in {key} has {len(shape)} dimensions; at most {wire.MAX_DIMS}")
                maps.append(tensor.get("parameters"))
    for params in maps:
        if isinstance(params, dict) and len(params) > MAX_PARAMETERS:
            raise InvalidInput(f"a parameters object has {len(params)} entries; at most {MAX_PARAMETERS}")


def _binary_slices(req: InferenceRequest, binary: memoryview) -> list[memoryview | None]:
    """Each input's binary bytes (the binary tensor data extension: they follow the JSON
    header in input order, `binary_data_size` each), None for an input without any."""
    sizes = [_binary_size(spec) for spec in req.inputs]
    declared = sum(s for s in sizes if s is not None)
    if declared != len(binary):
        if declared == 0:
            raise BadRequest(f"{len(binary)} bytes follow the JSON header but no input has a binary_data_size")
        raise BadRequest(f"the inputs declare binary_data_size {declared} in all; {len(binary)} bytes follow the header")
    raws: list[memoryview | None] = []
    offset = 0
    for size in sizes:
        if size is None:
            raws.append(None)
        else:
            raws.append(binary[offset:offset + size])
            offset += size
    return raws


def _decode_input(
    req: InferenceRequest, raws: Sequence[memoryview | bytes | None], limits: codecs.Limits
) -> tuple[np.ndarray, np.ndarray | None, bool]:
    """The input tensor (shape-checked against the limits before its data is decoded) and the
    optional `attention_mask` input, raw: (hidden_states, mask or None, squeezed). `raws[i]`
    is input i's binary bytes (None: its JSON / typed `data`)."""
    names = [i.name for i in req.inputs]
    if wire.INPUT_NAME not in names or len(set(names)) != len(names) or not set(names) <= {
        wire.INPUT_NAME, wire.MASK_NAME
    }:
        raise InvalidInput(
            f"model {MODEL_NAME!r} takes one input {wire.INPUT_NAME!r} and optionally {wire.MASK_NAME!r}; "
            f"got {wire.snip(names)}"
        )
    squeezed = False
    decoded: dict[str, np.ndarray] = {}
    for spec, raw in zip(req.inputs, raws):
        params = spec.parameters or {}
        if "shared_memory_region" in params:
            raise BadRequest("shared-memory inputs are not supported here; send the tensor's data")
        if any(d < 0 for d in spec.shape):
            raise InvalidInput(f"input {spec.name!r} shape must be concrete (no -1); got {wire.snip(spec.shape)}")
        is_mask = spec.name == wire.MASK_NAME
        if not is_mask:
            if spec.datatype not in codecs.OIP_TO_NP:
                raise InvalidInput(
                    f"input {spec.name!r} datatype must be one of {', '.join(codecs.OIP_TO_NP)}; "
                    f"got {wire.snip(spec.datatype)}"
                )
            squeezed = limits.check(spec.shape)
        if raw is None and spec.data is None:
            raise BadRequest(f"input {spec.name!r} has neither JSON 'data' nor a binary_data_size parameter")
        if raw is not None and spec.data is not None:
            raise BadRequest(f"input {spec.name!r} has both JSON 'data' and binary_data_size; send one")
        decode = codecs.decode_oip_mask if is_mask else codecs.decode_oip_tensor
        decoded[spec.name] = decode(spec.datatype, spec.shape, data=None if raw is not None else spec.data,
                                    raw=raw, name=spec.name)
    return decoded[wire.INPUT_NAME], decoded.get(wire.MASK_NAME), squeezed


def _binary_size(spec: RequestInput) -> int | None:
    size = (spec.parameters or {}).get("binary_data_size")
    if size is not None and (type(size) is not int or size < 0):
        raise BadRequest(
            f"binary_data_size of input {spec.name!r} must be a non-negative integer; got {wire.snip(size)}"
        )
    return size


def causal(req: InferenceRequest) -> bool | None:
    """`parameters.causal` (a boolean), None when absent: the served model's default."""
    value = (req.parameters or {}).get("causal")
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"parameter causal must be a boolean; got {value!r:.50}")
    return value


def binary_outputs(req: InferenceRequest) -> bool:
    """Whether `output` goes back as raw bytes (per-output binary_data, else binary_data_output)."""
    default = (req.parameters or {}).get("binary_data_output", False)
    if not isinstance(default, bool):
        raise BadRequest(f"parameter binary_data_output must be a boolean; got {default!r:.50}")
    if not req.outputs:
        return default
    binary = default
    for out in req.outputs:
        if out.name != wire.OUTPUT_NAME:
            raise InvalidInput(f"model {MODEL_NAME!r} has one output {wire.OUTPUT_NAME!r}; asked for {out.name!r:.50}")
        params = out.parameters or {}
        if params.get("classification"):
            raise BadRequest("the classification extension is not supported: the output is a dense tensor")
        flag = params.get("binary_data", default)
        if not isinstance(flag, bool):
            raise BadRequest(f"parameter binary_data of output {out.name!r} must be a boolean; got {flag!r:.50}")
        binary = flag
    return binary


def reply(req: InferenceRequest, out: np.ndarray, binary: bool, parameters: dict[str, Any] | None = None) -> Response:
    tensor: dict[str, Any] = {"name": wire.OUTPUT_NAME, "datatype": codecs.oip_datatype(out.dtype), "shape": list(out.shape)}
    doc: dict[str, Any] = {"model_name": MODEL_NAME, "model_version": MODEL_VERSION, "outputs": [tensor]}
    if req.id is not None:
        doc["id"] = req.id
    if parameters:  # a sequence's answer: its length and the weights version (service.ingress.oip.sequences)
        doc["parameters"] = parameters
    if not binary:
        tensor["data"] = wire.json_values(out.reshape(-1))  # serialized in chunks
        return Response(orjson.dumps(doc), media_type=wire.JSON)
    raw = codecs.raw_bytes(out)
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = orjson.dumps(doc)
    return Response(b"".join([header, raw]), media_type=BINARY_MEDIA, headers={HEADER_LENGTH: str(len(header))})


def content_encoding(header: str | None) -> str:
    """'identity', 'gzip' or 'deflate' (tritonclient's request_compression_algorithm); else 415."""
    encoding = (header or "identity").strip().lower()
    if encoding not in ("identity", "gzip", "deflate"):
        raise UnsupportedMediaType(f"Content-Encoding {wire.snip(encoding)} is not supported; use gzip, deflate or none")
    return encoding


def _decompress(body: bytes, encoding: str, limit: int, limit_name: str) -> bytes:
    """gzip / deflate request bodies, inflated to at most `limit` bytes (zlib gives the
    interpreter lock back while it inflates); a body that inflates further is 413."""
    if encoding == "identity":
        return body
    # wbits: 16+MAX for a gzip wrapper, MAX for zlib ("deflate" in HTTP means zlib-wrapped).
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error:
        raise BadRequest(f"body is not valid {encoding} data") from None
    if len(data) > limit or inflater.unconsumed_tail:
        raise PayloadTooLarge(f"the {encoding} body inflates past {limit_name}={limit}")
    if not inflater.eof:
        raise BadRequest(f"{encoding} body is truncated")
    return data
