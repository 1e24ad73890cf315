"""The OIP v2 routes: GET /v2, /v2/health/*, /v2/models/attention[/versions/1][/ready], and
POST .../infer (service.ingress.oip says what they take; service.ingress.oip.codec decodes)."""
from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response

from service.contract import deadlines
from service.config.builder_args import AppConfig
from service.contract.errors import NotFound, PayloadTooLarge, UnsupportedMediaType
from service.ingress import codecs
from service.ingress.auth import inference_auth
from service.ingress.deps import (
    DecodePool, check_declared_length, get_config, get_decode_pool,
    FleetReader, Gang, get_fleet, get_gang, read_body_capped,
)

from service.ingress.oip.codec import CheckedInputs, content_encoding, prepare, reply
from service.ingress.oip.inference import answer, deadline_of
from service.ingress.oip.schemas import (
    BINARY_MEDIA, HEADER_LENGTH, MODEL_NAME, MODEL_VERSION, SERVER_NAME, SERVER_VERSION, InferenceRequest,
    InferenceResponse, Liveness, ModelMetadata, Readiness, ServerMetadata, TensorMetadata,
)
from service.ingress.readiness import readiness
from service.ingress.schemas import INFER_ERROR_RESPONSES, OPTIONAL_INFER_SECURITY, ErrorBody, inline_defs

router = APIRouter(prefix="/v2", tags=["open inference protocol v2"])


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
async def server_ready(gang: Gang = Depends(get_gang), fleet: FleetReader = Depends(get_fleet)) -> Readiness:
    await _require_ready(gang, fleet)
    return Readiness(ready=True)


@router.get(f"/models/{MODEL_NAME}", summary="Model metadata", response_model=ModelMetadata)
async def model_metadata(cfg: AppConfig = Depends(get_config)) -> ModelMetadata:
    return metadata_of(cfg)


@router.get(f"/models/{MODEL_NAME}/versions/{{version}}", summary="Model metadata (versioned)",
            response_model=ModelMetadata, responses=_VERSION_404)
async def model_metadata_version(version: str, cfg: AppConfig = Depends(get_config)) -> ModelMetadata:
    check_version(version)
    return metadata_of(cfg)


@router.get(f"/models/{MODEL_NAME}/ready", summary="200 when the model can serve, else 503",
            response_model=Readiness, responses=_NOT_READY)
async def model_ready(gang: Gang = Depends(get_gang), fleet: FleetReader = Depends(get_fleet)) -> Readiness:
    await _require_ready(gang, fleet)
    return Readiness(ready=True)


@router.get(f"/models/{MODEL_NAME}/versions/{{version}}/ready", summary="Model readiness (versioned)",
            response_model=Readiness, responses={**_NOT_READY, **_VERSION_404})
async def model_ready_version(version: str, gang: Gang = Depends(get_gang),
                              fleet: FleetReader = Depends(get_fleet)) -> Readiness:
    check_version(version)
    await _require_ready(gang, fleet)
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
    gang: Gang = Depends(get_gang),
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
    gang: Gang = Depends(get_gang),
    pool: DecodePool = Depends(get_decode_pool),
) -> Response:
    check_version(version)
    return await _infer(request, output_dtype, header_length, cfg, gang, pool)


async def _infer(
    request: Request, output_dtype: str | None, header_length: int | None, cfg: AppConfig, gang: Gang,
    pool: DecodePool,
) -> Response:
    started = time.monotonic()  # the deadline counts from here (service.contract.deadlines)
    header_s = deadlines.header_timeout(request.headers.get(deadlines.HEADER))
    media = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media not in ("", codecs.JSON, BINARY_MEDIA):
        raise UnsupportedMediaType(
            f"Content-Type {codecs.snip(media)} is not supported here; use {codecs.JSON} or {BINARY_MEDIA}"
        )
    encoding = content_encoding(request.headers.get("content-encoding"))
    if header_length is not None and header_length > cfg.serving.max_json_bytes:
        raise PayloadTooLarge(f"{HEADER_LENGTH} is {header_length}; the limit is max_json_bytes={cfg.serving.max_json_bytes}")
    # A body that is all JSON is capped at max_json_bytes (after decompression too).
    json_only = header_length is None
    check_declared_length(request, cfg.serving.max_body_bytes)
    if json_only and encoding == "identity":
        body = await read_body_capped(request, cfg.serving.max_json_bytes, "max_json_bytes")
    else:
        body = await read_body_capped(request, cfg.serving.max_body_bytes)
    limits = codecs.Limits.of(cfg)
    cap = (cfg.serving.max_json_bytes, "max_json_bytes") if json_only else (cfg.serving.max_body_bytes, "max_body_bytes")
    req, x, mask, squeezed, reply_dtype, binary = await pool.decode(
        prepare, body, encoding, cap, header_length, limits, output_dtype,
        inline=encoding == "identity" and len(body) <= cfg.tunables.ingress.inline_decode_bytes)
    inputs = CheckedInputs(x, mask, squeezed, reply_dtype)
    result = await answer(req, inputs, gang, deadline_of(req, started, cfg, header_s))
    if result.output.size > cfg.tunables.ingress.inline_encode_values:
        return await pool.run_unbounded(reply, req, result.output, binary, result.parameters)
    return reply(req, result.output, binary, result.parameters)


# ---------------------------------------------------------------- helpers

def metadata_of(cfg: AppConfig) -> ModelMetadata:
    """The served model's OIP metadata (HTTP and gRPC answer the same)."""
    shape = [-1, -1, cfg.model.embed_dim]
    return ModelMetadata(
        name=MODEL_NAME,
        versions=[MODEL_VERSION],
        platform="gangserve_tensor_parallel_attention",
        # attention_mask is optional, and OIP metadata cannot say so: it is documented, not listed.
        inputs=[TensorMetadata(name=codecs.INPUT_NAME, datatype="FP32", shape=shape)],
        outputs=[TensorMetadata(name=codecs.OUTPUT_NAME, datatype="FP32", shape=shape)],
    )


def check_version(version: str) -> None:
    """404 `not_found` unless `version` is the served model's (HTTP and gRPC alike)."""
    if version != MODEL_VERSION:
        raise NotFound(f"model {MODEL_NAME!r} has version {MODEL_VERSION!r} only; got {version!r:.50}")


async def _require_ready(gang: Gang, fleet: FleetReader) -> None:
    """The same readiness as /readyz (one function, one answer)."""
    await readiness(gang, fleet)
