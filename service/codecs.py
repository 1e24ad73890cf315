"""Tensor wire formats: safetensors, npy and JSON. One module, used by every route.

decode(body, media_type) -> np.ndarray, encode(array, media_type) -> bytes. Parsing
errors raise BadRequest (400); a parsed body with the wrong content raises InvalidInput
(422). Nothing here ever unpickles: npy is read with allow_pickle=False.
"""
from __future__ import annotations

import io
import struct

import numpy as np
import orjson
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from service.errors import BadRequest, InvalidInput, NotAcceptable, UnsupportedMediaType

SAFETENSORS = "application/x-safetensors"
NPY = "application/x-npy"
JSON = "application/json"
MEDIA_TYPES = (SAFETENSORS, NPY, JSON)

INPUT_NAME = "hidden_states"
OUTPUT_NAME = "output"
MAX_SAFETENSORS_HEADER = 1 << 20  # 1 MiB of JSON header is far more than one tensor needs
NPY_MAGIC = b"\x93NUMPY"


def media_type_of(content_type: str | None) -> str:
    """The request's media type, or UnsupportedMediaType naming the supported ones."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media in MEDIA_TYPES:
        return media
    raise UnsupportedMediaType(
        f"Content-Type {content_type or '(none)'!r} is not supported; use one of {', '.join(MEDIA_TYPES)}"
    )


def negotiate(accept: str | None, request_media: str) -> str:
    """Reply media type from Accept; '*/*' or no header means 'same as the request'."""
    if not accept:
        return request_media
    wanted = [part.split(";", 1)[0].strip().lower() for part in accept.split(",")]
    for media in wanted:
        if media in ("*/*", "application/*", ""):
            return request_media
        if media in MEDIA_TYPES:
            return media
    raise NotAcceptable(f"Accept {accept!r} matches none of {', '.join(MEDIA_TYPES)}")


def decode(body: bytes, media_type: str) -> np.ndarray:
    if not body:
        raise BadRequest("request body is empty")
    if media_type == SAFETENSORS:
        return _decode_safetensors(body)
    if media_type == NPY:
        return _decode_npy(body)
    if media_type == JSON:
        return _decode_json(body)
    raise UnsupportedMediaType(f"no decoder for {media_type!r}")


def encode(array: np.ndarray, media_type: str) -> bytes:
    if media_type == SAFETENSORS:
        return st_save({OUTPUT_NAME: np.ascontiguousarray(array)})
    if media_type == NPY:
        buf = io.BytesIO()
        np.save(buf, array, allow_pickle=False)
        return buf.getvalue()
    if media_type == JSON:
        payload = {"output": array, "shape": list(array.shape), "dtype": str(array.dtype)}
        return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    raise NotAcceptable(f"no encoder for {media_type!r}")


def _decode_safetensors(body: bytes) -> np.ndarray:
    if len(body) < 8:
        raise BadRequest(f"safetensors body is {len(body)} bytes; it needs at least an 8-byte header length")
    (header_len,) = struct.unpack("<Q", body[:8])
    if header_len > MAX_SAFETENSORS_HEADER or 8 + header_len > len(body):
        raise BadRequest(
            f"safetensors header claims {header_len} bytes; body has {len(body) - 8} after the length "
            f"(limit {MAX_SAFETENSORS_HEADER})"
        )
    try:
        tensors = st_load(body)
    except (SafetensorError, ValueError, TypeError) as exc:
        raise BadRequest(f"invalid safetensors body: {exc}") from None
    if INPUT_NAME not in tensors:
        raise InvalidInput(f"safetensors body needs a tensor named {INPUT_NAME!r}; found {sorted(tensors)}")
    return tensors[INPUT_NAME]


def _decode_npy(body: bytes) -> np.ndarray:
    if not body.startswith(NPY_MAGIC):
        raise BadRequest(f"npy body must start with the magic {NPY_MAGIC!r}; got {body[:8]!r}")
    # read_array (unlike np.load) never falls back to unpickling arbitrary bytes.
    fp = io.BytesIO(body)
    try:
        version = np.lib.format.read_magic(fp)
        read_header = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read_header(fp)
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise BadRequest(f"invalid npy header: {exc}") from None
    if dtype.hasobject:
        raise InvalidInput("npy body holds Python objects (pickled data); only numeric arrays are accepted")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    data = memoryview(body)[fp.tell():]
    if len(data) != expected:
        raise BadRequest(f"npy data is {len(data)} bytes; header {list(shape)} {dtype} needs {expected}")
    array = np.frombuffer(data, dtype=dtype)
    return array.reshape(shape[::-1]).T if fortran else array.reshape(shape)


def _decode_json(body: bytes) -> np.ndarray:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    if not isinstance(doc, dict) or INPUT_NAME not in doc:
        raise InvalidInput(f'JSON body must be an object {{"{INPUT_NAME}": [[...], ...]}}')
    try:
        return np.asarray(doc[INPUT_NAME], dtype=np.float32)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"{INPUT_NAME} must be a rectangular nested list of numbers: {exc}") from None


def validate_hidden_states(
    array: np.ndarray, *, embed_dim: int, max_seq_len: int, max_tokens: int
) -> tuple[np.ndarray, bool]:
    """Check an input tensor and bring it to [batch, seq, E] float32.

    Returns (array3d, squeezed) where squeezed says the request was [seq, E] and the
    reply must drop the batch dim again. Raises InvalidInput naming expected vs found.
    """
    if array.dtype.kind != "f":
        raise InvalidInput(f"{INPUT_NAME} must be a floating-point tensor; got dtype {array.dtype}")
    if array.ndim not in (2, 3):
        raise InvalidInput(
            f"{INPUT_NAME} must be [batch, seq, {embed_dim}] or [seq, {embed_dim}]; got shape {list(array.shape)}"
        )
    squeezed = array.ndim == 2
    x = array[None] if squeezed else array
    batch, seq, width = x.shape
    if width != embed_dim:
        raise InvalidInput(f"last dimension must be embed_dim={embed_dim}; got shape {list(array.shape)}")
    if batch == 0 or seq == 0:
        raise InvalidInput(f"{INPUT_NAME} must not be empty; got shape {list(array.shape)}")
    if seq > max_seq_len:
        raise InvalidInput(f"sequence length {seq} exceeds max_seq_len={max_seq_len}")
    if batch * seq > max_tokens:
        raise InvalidInput(f"batch * seq = {batch * seq} tokens exceeds max_tokens_per_request={max_tokens}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise InvalidInput(f"{INPUT_NAME} contains NaN or Inf (or values that overflow float32)")
    return x, squeezed
