"""Open Inference Protocol v2 (KServe / Triton HTTP/REST) for the model `attention`.

Routes: GET /v2, /v2/health/live, /v2/health/ready, /v2/models/attention[/versions/1],
.../ready, and POST .../infer with JSON tensors or the binary tensor data extension:
the body is the JSON inference header (`Inference-Header-Content-Length` bytes) followed
by the raw little-endian row-major bytes of every input whose parameters hold
`binary_data_size`, in input order. Outputs asked for with `binary_data: true` (or all of
them when the request has `binary_data_output: true`) come back the same way.

Tensors: one input `hidden_states` ([batch, seq, E] or [seq, E]; FP32, FP16, BF16 or FP64,
computed in the app's compute_dtype), an optional second input `attention_mask` ([batch, seq]
or [seq]; BOOL, UINT8, INT32 or INT64; 1 = token, 0 = padding), request parameter `causal`
(boolean), one output `output` of the same shape, in the input's datatype unless
the `output_dtype` query parameter asks for another. Errors are JSON `{"error", "code"}`
(OIP clients read `error`). Shapes and limits are checked before any tensor data is
decoded, and long before any compute.

Bounds: the body by max_body_bytes; a JSON-only body (no Inference-Header-Content-Length),
and the JSON header of a binary one, by max_json_bytes, counted after decompression (gzip /
deflate are inflated only up to that cap, in the DecodePool: never on the event loop).
"""
from __future__ import annotations

import zlib
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Header, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, WithJsonSchema

from service.ingress import codecs
from service.ingress.auth import inference_auth
from service.config import AppConfig
from service.errors import (
    BadRequest,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    UnsupportedMediaType,
    describe_validation_errors,
)
from service.ingress.deps import (
    INLINE_DECODE_BYTES, INLINE_ENCODE_VALUES, DecodePool, check_declared_length, get_config, get_decode_pool,
    get_gang, read_body_capped,
)
from service.ingress.gang_client import GangClient
from service.ingress.readiness import readiness
from service.ingress.schemas import INFER_ERROR_RESPONSES, OPTIONAL_INFER_SECURITY, ErrorBody, inline_defs

router = APIRouter(prefix="/v2", tags=["open inference protocol v2"])

MODEL_NAME = "attention"
MODEL_VERSION = "1"
SERVER_NAME = "gangserve"
SERVER_VERSION = "0.1.0"
BINARY_MEDIA = "application/octet-stream"
HEADER_LENGTH = "Inference-Header-Content-Length"
# Bounds checked on the parsed JSON before pydantic walks it (it would walk any list).
MAX_TENSORS = 16
MAX_PARAMETERS = 64
MAX_ID_CHARS = 1024


# ---------------------------------------------------------------- schemas

class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1 marks a free dimension")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class Readiness(BaseModel):
    ready: bool


class Liveness(BaseModel):
    live: bool


# JSON `data` is passed through untouched (no per-element validation): numpy checks it.
_Data = Annotated[Any, WithJsonSchema({"type": "array", "items": {}, "description": "row-major values, flat or nested"})]


class RequestInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    shape: list[StrictInt]
    datatype: str = Field(description="FP32, FP16, BF16 or FP64")
    parameters: dict[str, Any] | None = Field(None, description="binary_data_size: bytes of this input after the header")
    data: _Data = None


class RequestOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    parameters: dict[str, Any] | None = Field(None, description="binary_data: reply with raw bytes")


class InferenceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    parameters: dict[str, Any] | None = Field(
        None, description="binary_data_output: every output as raw bytes; causal: causal attention (boolean)"
    )
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: _Data = None


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[ResponseOutput]


_BINARY_BODY = {
    "type": "string",
    "format": "binary",
    "description": f"binary tensor data extension: the JSON InferenceRequest ({HEADER_LENGTH} bytes), "
    "then the raw bytes of each input with a binary_data_size parameter, in input order",
}


_INFER_DOC: dict[str, Any] = {
    **OPTIONAL_INFER_SECURITY,
    "requestBody": {
        "required": True,
        "content": {
            codecs.JSON: {"schema": inline_defs(InferenceRequest.model_json_schema())},
            BINARY_MEDIA: {"schema": _BINARY_BODY},
        },
    }
}
_INFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": f"the output tensor; with binary outputs the body is the JSON header ({HEADER_LENGTH} "
        "bytes) followed by the raw output bytes",
        "content": {
            codecs.JSON: {"schema": inline_defs(InferenceResponse.model_json_schema())},
            BINARY_MEDIA: {"schema": {"type": "string", "format": "binary"}},
        },
    },
    404: {"model": ErrorBody, "description": "unknown model version"},
    **{k: v for k, v in INFER_ERROR_RESPONSES.items() if k != 406},
}
_NOT_READY = {503: {"model": ErrorBody, "description": "gang not ready; has Retry-After"}}
_VERSION_404 = {404: {"model": ErrorBody, "description": "unknown model version"}}


# ---------------------------------------------------------------- server and model metadata

@router.get("", summary="Server metadata", response_model=ServerMetadata)
async def server_metadata() -> ServerMetadata:
    return ServerMetadata(name=SERVER_NAME, version=SERVER_VERSION, extensions=["binary_tensor_data"])


@router.get("/health/live", summary="200 while the server serves HTTP", response_model=Liveness)
async def server_live() -> Liveness:
    return Liveness(live=True)


@router.get("/health/ready", summary="200 when the gang can serve, else 503", response_model=Readiness,
            responses=_NOT_READY)
async def server_ready(gang: GangClient = Depends(get_gang)) -> Readiness:
    await _require_ready(gang)
    return Readiness(ready=True)


@router.get(f"/models/{MODEL_NAME}", summary="Model metadata", response_model=ModelMetadata)
async def model_metadata(cfg: AppConfig = Depends(get_config)) -> ModelMetadata:
    return _metadata(cfg)


@router.get(f"/models/{MODEL_NAME}/versions/{{version}}", summary="Model metadata (versioned)",
            response_model=ModelMetadata, responses=_VERSION_404)
async def model_metadata_version(version: str, cfg: AppConfig = Depends(get_config)) -> ModelMetadata:
    _check_version(version)
    return _metadata(cfg)


@router.get(f"/models/{MODEL_NAME}/ready", summary="200 when the model can serve, else 503",
            response_model=Readiness, responses=_NOT_READY)
async def model_ready(gang: GangClient = Depends(get_gang)) -> Readiness:
    await _require_ready(gang)
    return Readiness(ready=True)


@router.get(f"/models/{MODEL_NAME}/versions/{{version}}/ready", summary="Model readiness (versioned)",
            response_model=Readiness, responses={**_NOT_READY, **_VERSION_404})
async def model_ready_version(version: str, gang: GangClient = Depends(get_gang)) -> Readiness:
    _check_version(version)
    await _require_ready(gang)
    return Readiness(ready=True)


# ---------------------------------------------------------------- inference

_OutputDtype = Query(None, description="Output datatype; default: the input's (FP32 / FP16 / BF16 / FP64).")
_HeaderLength = Header(None, alias=HEADER_LENGTH, ge=0,
                       description="Length of the JSON header when binary tensor data follows it")
_DtypeName = Literal["float32", "float16", "bfloat16", "float64"]


@router.post(f"/models/{MODEL_NAME}/infer", summary="Inference (JSON tensors or binary tensor data)",
             response_class=Response, openapi_extra=_INFER_DOC, responses=_INFER_RESPONSES,
             dependencies=[Depends(inference_auth)])
async def infer(
    request: Request,
    output_dtype: _DtypeName | None = _OutputDtype,
    header_length: int | None = _HeaderLength,
    cfg: AppConfig = Depends(get_config),
    gang: GangClient = Depends(get_gang),
    pool: DecodePool = Depends(get_decode_pool),
) -> Response:
    return await _infer(request, output_dtype, header_length, cfg, gang, pool)


@router.post(f"/models/{MODEL_NAME}/versions/{{version}}/infer", summary="Inference (versioned)",
             response_class=Response, openapi_extra=_INFER_DOC, responses=_INFER_RESPONSES,
             dependencies=[Depends(inference_auth)])
async def infer_version(
    version: str,
    request: Request,
    output_dtype: _DtypeName | None = _OutputDtype,
    header_length: int | None = _HeaderLength,
    cfg: AppConfig = Depends(get_config),
    gang: GangClient = Depends(get_gang),
    pool: DecodePool = Depends(get_decode_pool),
) -> Response:
    _check_version(version)
    return await _infer(request, output_dtype, header_length, cfg, gang, pool)


async def _infer(
    request: Request, output_dtype: str | None, header_length: int | None, cfg: AppConfig, gang: GangClient,
    pool: DecodePool,
) -> Response:
    media = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media not in ("", codecs.JSON, BINARY_MEDIA):
        raise UnsupportedMediaType(
            f"Content-Type {codecs.snip(media)} is not supported here; use {codecs.JSON} or {BINARY_MEDIA}"
        )
    encoding = _content_encoding(request.headers.get("content-encoding"))
    if header_length is not None and header_length > cfg.max_json_bytes:
        raise PayloadTooLarge(f"{HEADER_LENGTH} is {header_length}; the limit is max_json_bytes={cfg.max_json_bytes}")
    # A body that is all JSON is capped at max_json_bytes (after decompression too).
    json_only = header_length is None
    check_declared_length(request, cfg.max_body_bytes)
    if json_only and encoding == "identity":
        body = await read_body_capped(request, cfg.max_json_bytes, "max_json_bytes")
    else:
        body = await read_body_capped(request, cfg.max_body_bytes)
    limits = codecs.Limits(cfg.embed_dim, cfg.max_seq_len, cfg.max_tokens_per_request, cfg.max_json_bytes)
    cap = (cfg.max_json_bytes, "max_json_bytes") if json_only else (cfg.max_body_bytes, "max_body_bytes")
    args = (body, encoding, cap, header_length, limits, output_dtype)
    if encoding != "identity" or len(body) > INLINE_DECODE_BYTES:
        req, x, mask, squeezed, reply_dtype, binary = await pool.run(_prepare, *args)
    else:
        req, x, mask, squeezed, reply_dtype, binary = _prepare(*args)
    out = await gang.infer(x, mask, _causal(req))  # [batch, seq, E] float32
    out = codecs.cast_reply(out[0] if squeezed else out, reply_dtype)
    if out.size > INLINE_ENCODE_VALUES:
        return await pool.run_unbounded(_reply, req, out, binary)
    return _reply(req, out, binary)


def _prepare(
    body: bytes, encoding: str, cap: tuple[int, str], header_length: int | None, limits: codecs.Limits,
    output_dtype: str | None,
) -> tuple[InferenceRequest, np.ndarray, np.ndarray | None, bool, np.dtype, bool]:
    """Inflate (capped), parse and check the request, and decode its input tensors:
    (request, x [batch, seq, E] float32, key mask [batch, seq] bool or None, squeezed,
    reply dtype, binary output)."""
    body = _decompress(body, encoding, *cap)
    if not body:
        raise BadRequest("request body is empty; it needs a JSON inference request")
    view = memoryview(body)
    if header_length is None:
        header_length = len(view)
    elif header_length > len(view):
        raise BadRequest(f"{HEADER_LENGTH} is {header_length}; the body has only {len(view)} bytes")
    req = _parse_request(view[:header_length], limits)
    array, raw_mask, squeezed = _decode_input(req, view[header_length:], limits)
    reply_dtype = codecs.reply_dtype(array.dtype, output_dtype)
    x = codecs.to_model_input(array)
    mask = codecs.validate_attention_mask(raw_mask, x.shape, squeezed)
    return req, x, mask, squeezed, reply_dtype, _binary_outputs(req)


def _parse_request(header: memoryview, limits: codecs.Limits) -> InferenceRequest:
    doc = codecs.loads_json(header, limits, what="inference request")
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
                if isinstance(shape, list) and len(shape) > codecs.MAX_DIMS:
                    raise InvalidInput(f"a shape in {key} has {len(shape)} dimensions; at most {codecs.MAX_DIMS}")
                maps.append(tensor.get("parameters"))
    for params in maps:
        if isinstance(params, dict) and len(params) > MAX_PARAMETERS:
            raise InvalidInput(f"a parameters object has {len(params)} entries; at most {MAX_PARAMETERS}")


def _decode_input(
    req: InferenceRequest, binary: memoryview, limits: codecs.Limits
) -> tuple[np.ndarray, np.ndarray | None, bool]:
    """The input tensor (shape-checked against the limits before its data is decoded) and the
    optional `attention_mask` input, raw: (hidden_states, mask or None, squeezed). Binary
    data follows the header in input order."""
    names = [i.name for i in req.inputs]
    if codecs.INPUT_NAME not in names or len(set(names)) != len(names) or not set(names) <= {
        codecs.INPUT_NAME, codecs.MASK_NAME
    }:
        raise InvalidInput(
            f"model {MODEL_NAME!r} takes one input {codecs.INPUT_NAME!r} and optionally {codecs.MASK_NAME!r}; "
            f"got {codecs.snip(names)}"
        )
    squeezed = False
    offset = 0
    decoded: dict[str, np.ndarray] = {}
    sizes = [_binary_size(spec) for spec in req.inputs]
    if sum(s for s in sizes if s is not None) != len(binary):
        declared = sum(s for s in sizes if s is not None)
        if declared == 0:
            raise BadRequest(f"{len(binary)} bytes follow the JSON header but no input has a binary_data_size")
        raise BadRequest(f"the inputs declare binary_data_size {declared} in all; {len(binary)} bytes follow the header")
    for spec, size in zip(req.inputs, sizes):
        params = spec.parameters or {}
        if "shared_memory_region" in params:
            raise BadRequest("shared-memory inputs are not supported over HTTP here; send JSON data or binary data")
        if any(d < 0 for d in spec.shape):
            raise InvalidInput(f"input {spec.name!r} shape must be concrete (no -1); got {codecs.snip(spec.shape)}")
        is_mask = spec.name == codecs.MASK_NAME
        if not is_mask:
            if spec.datatype not in codecs.OIP_TO_NP:
                raise InvalidInput(
                    f"input {spec.name!r} datatype must be one of {', '.join(codecs.OIP_TO_NP)}; "
                    f"got {codecs.snip(spec.datatype)}"
                )
            squeezed = limits.check(spec.shape)
        raw = None
        if size is None:
            if spec.data is None:
                raise BadRequest(f"input {spec.name!r} has neither JSON 'data' nor a binary_data_size parameter")
        else:
            if spec.data is not None:
                raise BadRequest(f"input {spec.name!r} has both JSON 'data' and binary_data_size; send one")
            raw, offset = binary[offset:offset + size], offset + size
        decode = codecs.decode_oip_mask if is_mask else codecs.decode_oip_tensor
        decoded[spec.name] = decode(spec.datatype, spec.shape, data=None if raw is not None else spec.data,
                                    raw=raw, name=spec.name)
    return decoded[codecs.INPUT_NAME], decoded.get(codecs.MASK_NAME), squeezed


def _binary_size(spec: RequestInput) -> int | None:
    size = (spec.parameters or {}).get("binary_data_size")
    if size is not None and (type(size) is not int or size < 0):
        raise BadRequest(
            f"binary_data_size of input {spec.name!r} must be a non-negative integer; got {codecs.snip(size)}"
        )
    return size


def _causal(req: InferenceRequest) -> bool | None:
    """`parameters.causal` (a boolean), None when absent: the served model's default."""
    value = (req.parameters or {}).get("causal")
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"parameter causal must be a boolean; got {value!r:.50}")
    return value


def _binary_outputs(req: InferenceRequest) -> bool:
    """Whether `output` goes back as raw bytes (per-output binary_data, else binary_data_output)."""
    default = (req.parameters or {}).get("binary_data_output", False)
    if not isinstance(default, bool):
        raise BadRequest(f"parameter binary_data_output must be a boolean; got {default!r:.50}")
    if not req.outputs:
        return default
    binary = default
    for out in req.outputs:
        if out.name != codecs.OUTPUT_NAME:
            raise InvalidInput(f"model {MODEL_NAME!r} has one output {codecs.OUTPUT_NAME!r}; asked for {out.name!r:.50}")
        params = out.parameters or {}
        if params.get("classification"):
            raise BadRequest("the classification extension is not supported: the output is a dense tensor")
        flag = params.get("binary_data", default)
        if not isinstance(flag, bool):
            raise BadRequest(f"parameter binary_data of output {out.name!r} must be a boolean; got {flag!r:.50}")
        binary = flag
    return binary


def _reply(req: InferenceRequest, out: np.ndarray, binary: bool) -> Response:
    tensor: dict[str, Any] = {"name": codecs.OUTPUT_NAME, "datatype": codecs.oip_datatype(out.dtype), "shape": list(out.shape)}
    doc: dict[str, Any] = {"model_name": MODEL_NAME, "model_version": MODEL_VERSION, "outputs": [tensor]}
    if req.id is not None:
        doc["id"] = req.id
    if not binary:
        tensor["data"] = codecs.json_values(out.reshape(-1))  # serialized in chunks
        return Response(orjson.dumps(doc), media_type=codecs.JSON)
    raw = codecs.raw_bytes(out)
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = orjson.dumps(doc)
    return Response(b"".join([header, raw]), media_type=BINARY_MEDIA, headers={HEADER_LENGTH: str(len(header))})


# ---------------------------------------------------------------- helpers

def _metadata(cfg: AppConfig) -> ModelMetadata:
    shape = [-1, -1, cfg.embed_dim]
    return ModelMetadata(
        name=MODEL_NAME,
        versions=[MODEL_VERSION],
        platform="gangserve_tensor_parallel_attention",
        # attention_mask is optional, and OIP metadata cannot say so: it is documented, not listed.
        inputs=[TensorMetadata(name=codecs.INPUT_NAME, datatype="FP32", shape=shape)],
        outputs=[TensorMetadata(name=codecs.OUTPUT_NAME, datatype="FP32", shape=shape)],
    )


def _check_version(version: str) -> None:
    if version != MODEL_VERSION:
        raise NotFound(f"model {MODEL_NAME!r} has version {MODEL_VERSION!r} only; got {version!r:.50}")


async def _require_ready(gang: GangClient) -> None:
    """The same readiness as /readyz (one function, one answer)."""
    await readiness(gang)


def _content_encoding(header: str | None) -> str:
    """'identity', 'gzip' or 'deflate' (tritonclient's request_compression_algorithm); else 415."""
    encoding = (header or "identity").strip().lower()
    if encoding not in ("identity", "gzip", "deflate"):
        raise UnsupportedMediaType(f"Content-Encoding {codecs.snip(encoding)} is not supported; use gzip, deflate or none")
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
