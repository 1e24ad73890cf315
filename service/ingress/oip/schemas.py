"""The Open Inference Protocol v2's pydantic models, names and bounds (service.ingress.oip)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, WithJsonSchema

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
        None, description="binary_data_output: every output as raw bytes; causal: causal attention (boolean); "
        "sequence_id, sequence_start, sequence_end: a session (Triton's sequence names); idempotency_key: a "
        "sequence request's key (1-128 visible ASCII characters), the same on its retries"
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
