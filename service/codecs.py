"""Tensor wire formats: safetensors, npy, JSON and Open Inference Protocol v2 tensors.

One module, used by every route. Contracts:

- `decode(body, media_type) -> np.ndarray` returns the request tensor in its *wire* dtype
  (float16, bfloat16 as `ml_dtypes.bfloat16`, float32, float64; anything else is returned
  too and refused by `validate_hidden_states`). Binary formats are decoded zero-copy: the
  array is a read-only view of `body`.
- `encode(array, media_type) -> bytes` writes the reply tensor in the array's dtype.
- `validate_hidden_states` checks shape and limits (`check_shape`, before any compute) and
  converts to the model dtype, float32 (`to_model_input`), refusing NaN/Inf.
- `reply_dtype(request_dtype, override)` is the dtype rule: the reply has the request's
  dtype unless the caller asks for another one (`output_dtype`).

Parsing errors raise BadRequest (400); a parsed body with the wrong content raises
InvalidInput (422). Nothing here ever unpickles: npy headers are parsed with
`read_array_header_*` and object dtypes are refused; safetensors headers are parsed here,
with the header length capped and every offset bounds-checked before any slicing.
"""
from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import orjson

from service.errors import BadRequest, InvalidInput, NotAcceptable, UnsupportedMediaType

SAFETENSORS = "application/x-safetensors"
NPY = "application/x-npy"
JSON = "application/json"
MEDIA_TYPES = (SAFETENSORS, NPY, JSON)

INPUT_NAME = "hidden_states"
OUTPUT_NAME = "output"
MAX_SAFETENSORS_HEADER = 1 << 20  # 1 MiB of JSON header is far more than one tensor needs
NPY_MAGIC = b"\x93NUMPY"

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
MODEL_DTYPE = np.dtype(np.float32)
# Floating dtypes accepted on the wire, by their public name (the `dtype` of JSON bodies,
# the `output_dtype` query parameter). All are computed in MODEL_DTYPE.
FLOAT_DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": BFLOAT16,
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
DTYPE_NAMES = tuple(FLOAT_DTYPES)

# safetensors dtype codes <-> numpy. Integer/bool codes are parsed (so the error is the
# precise 422 "must be floating point", not a 400) but never computed.
_ST_TO_NP: dict[str, np.dtype] = {
    "F16": np.dtype("<f2"), "BF16": BFLOAT16, "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "I16": np.dtype("<i2"), "U16": np.dtype("<u2"),
    "I32": np.dtype("<i4"), "U32": np.dtype("<u4"), "I64": np.dtype("<i8"), "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"),
}
_NP_TO_ST = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}

# Open Inference Protocol v2 datatypes (only the floating ones are served).
OIP_TO_NP: dict[str, np.dtype] = {
    "FP16": np.dtype("<f2"), "BF16": BFLOAT16, "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
NP_TO_OIP = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32", "float64": "FP64"}


def dtype_name(dtype: np.dtype) -> str:
    """Public name of a numpy dtype ('bfloat16' for ml_dtypes' bfloat16, else numpy's name)."""
    return "bfloat16" if dtype == BFLOAT16 else np.dtype(dtype).name


# ---------------------------------------------------------------- media negotiation

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


def reply_dtype(request_dtype: np.dtype, override: str | None, media_type: str | None = None) -> np.dtype:
    """The reply's dtype: `override` if given (a FLOAT_DTYPES name), else the request's.

    npy cannot carry bfloat16 (numpy has no such dtype; the file would say 'V2'), so a
    bfloat16 reply in npy is refused with 422 naming the formats that can.
    """
    if override is not None:
        if override not in FLOAT_DTYPES:
            raise InvalidInput(f"output_dtype must be one of {', '.join(DTYPE_NAMES)}; got {override!r}")
        dtype = FLOAT_DTYPES[override]
    else:
        dtype = np.dtype(request_dtype)
    if media_type == NPY and dtype == BFLOAT16:
        raise InvalidInput("npy cannot carry bfloat16; ask for Accept: application/x-safetensors or application/json")
    return dtype


# ---------------------------------------------------------------- decode / encode

def decode(body: bytes, media_type: str) -> np.ndarray:
    """The request tensor of `body` in its wire dtype (see the module docstring)."""
    if not body:
        raise BadRequest("request body is empty")
    if media_type == SAFETENSORS:
        return decode_safetensors(body)
    if media_type == NPY:
        return decode_npy(body)
    if media_type == JSON:
        return decode_json(body)
    raise UnsupportedMediaType(f"no decoder for {media_type!r}")


def encode(array: np.ndarray, media_type: str) -> bytes:
    """`array` in `media_type`, keeping its dtype (tensor `output`; JSON adds shape and dtype)."""
    if media_type == SAFETENSORS:
        return encode_safetensors({OUTPUT_NAME: array})
    if media_type == NPY:
        return encode_npy(array)
    if media_type == JSON:
        return encode_json(array)
    raise NotAcceptable(f"no encoder for {media_type!r}")


def decode_safetensors(body: bytes, name: str = INPUT_NAME) -> np.ndarray:
    """Tensor `name` of a safetensors body, as a zero-copy view of `body`.

    Layout: u64 little-endian header length N, N bytes of JSON header
    {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}?},
    then the data buffer; offsets are relative to the buffer's start.
    """
    view = memoryview(body)
    if len(view) < 8:
        raise BadRequest(f"safetensors body is {len(view)} bytes; it needs at least an 8-byte header length")
    (header_len,) = struct.unpack_from("<Q", view, 0)
    if header_len > MAX_SAFETENSORS_HEADER or 8 + header_len > len(view):
        raise BadRequest(
            f"safetensors header claims {header_len} bytes; body has {len(view) - 8} after the length "
            f"(limit {MAX_SAFETENSORS_HEADER})"
        )
    try:
        header = orjson.loads(view[8:8 + header_len])
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise BadRequest(f"safetensors header must be a JSON object; got {type(header).__name__}")
    names = sorted(k for k in header if k != "__metadata__")
    if name not in header:
        raise InvalidInput(f"safetensors body needs a tensor named {name!r}; found {names}")
    entry = header[name]
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise BadRequest(f"safetensors entry {name!r} needs dtype, shape and data_offsets; got {entry!r:.200}")
    dtype = _ST_TO_NP.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise InvalidInput(f"safetensors dtype {entry['dtype']!r} of {name!r} is not supported; use F32, F16 or BF16")
    shape = _shape_of(entry["shape"], f"safetensors shape of {name!r}")
    offsets = entry["data_offsets"]
    buffer_len = len(view) - 8 - header_len
    if (
        not isinstance(offsets, list) or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= buffer_len
    ):
        raise BadRequest(
            f"safetensors data_offsets of {name!r} must be [begin, end] within the {buffer_len}-byte buffer; "
            f"got {offsets!r:.100}"
        )
    begin, end = offsets
    needed = _nbytes(shape, dtype)
    if end - begin != needed:
        raise BadRequest(
            f"safetensors tensor {name!r} spans {end - begin} bytes; shape {list(shape)} {entry['dtype']} needs {needed}"
        )
    start = 8 + header_len + begin
    return np.frombuffer(view[start:start + needed], dtype=dtype).reshape(shape)


def encode_safetensors(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file of float tensors (header padded to 8 bytes, as the library does)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    arrays = []
    offset = 0
    for name, array in tensors.items():
        array = _little_endian(np.require(array, requirements="C"))
        code = _NP_TO_ST.get(dtype_name(array.dtype))
        if code is None:
            raise NotAcceptable(f"cannot write dtype {array.dtype} as safetensors; only {', '.join(_NP_TO_ST)}")
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    text = orjson.dumps(header)
    text += b" " * (-len(text) % 8)
    # One copy of the data, straight into the reply bytes.
    return b"".join([struct.pack("<Q", len(text)), text, *(a.reshape(-1).view(np.uint8).data for a in arrays)])


def decode_npy(body: bytes) -> np.ndarray:
    """The array of an npy body (zero-copy); object dtypes (pickles) are refused with 422."""
    if not body.startswith(NPY_MAGIC):
        raise BadRequest(f"npy body must start with the magic {NPY_MAGIC!r}; got {body[:8]!r}")
    # read_array_header (unlike np.load) never falls back to unpickling arbitrary bytes.
    fp = io.BytesIO(body)
    try:
        version = np.lib.format.read_magic(fp)
        read_header = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read_header(fp)
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as exc:
        raise BadRequest(f"invalid npy header: {exc}") from None
    if dtype.hasobject:
        raise InvalidInput("npy body holds Python objects (pickled data); only numeric arrays are accepted")
    expected = _nbytes(shape, dtype)
    data = memoryview(body)[fp.tell():]
    if len(data) != expected:
        raise BadRequest(f"npy data is {len(data)} bytes; header {list(shape)} {dtype} needs {expected}")
    array = np.frombuffer(data, dtype=dtype)
    return array.reshape(shape[::-1]).T if fortran else array.reshape(shape)


def encode_npy(array: np.ndarray) -> bytes:
    """npy v1 bytes of `array` (header + one copy of the data)."""
    if array.dtype == BFLOAT16:
        raise InvalidInput("npy cannot carry bfloat16; use safetensors or JSON")
    array = np.require(array, requirements="C")  # (ascontiguousarray would make 0-d arrays 1-d)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    return b"".join([header.getvalue(), array.reshape(-1).view(np.uint8).data])


def decode_json(body: bytes) -> np.ndarray:
    """`{"hidden_states": nested lists, "dtype"?: "float32"|"float16"|"bfloat16"|"float64", "shape"?: [...]}`.

    Values are cast to `dtype` (default float32): the request's dtype, which the reply
    keeps. Values out of that dtype's range become Inf and are refused by validation.
    With `shape`, the values (nested or flat, row-major) are reshaped to it.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    if not isinstance(doc, dict) or INPUT_NAME not in doc:
        found = sorted(doc)[:10] if isinstance(doc, dict) else type(doc).__name__
        raise InvalidInput(f'JSON body must be an object {{"{INPUT_NAME}": [[...], ...]}}; found {found}')
    name = doc.get("dtype", "float32")
    if name not in FLOAT_DTYPES:
        raise InvalidInput(f"JSON dtype must be one of {', '.join(DTYPE_NAMES)}; got {name!r:.50}")
    array = numbers_to_array(doc[INPUT_NAME], FLOAT_DTYPES[name], what=INPUT_NAME)
    if doc.get("shape") is None:
        return array
    # An explicit shape: flat data is fine, and zero-size shapes ([0, 512] vs [0]) stay exact.
    shape = _shape_of(doc["shape"], "JSON shape")
    count = _numel(shape)
    if array.size != count:
        raise InvalidInput(f"{INPUT_NAME} has {array.size} values; shape {list(shape)} needs {count}")
    return array.reshape(shape)


def encode_json(array: np.ndarray, name: str = OUTPUT_NAME) -> bytes:
    """`{name: nested lists, "shape": [...], "dtype": dtype name}`, serialized by orjson from numpy.

    With name="hidden_states" it is a valid request body (decode_json ignores "shape").
    """
    payload = {name: _json_ready(array), "shape": list(array.shape), "dtype": dtype_name(array.dtype)}
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def numbers_to_array(values: Any, dtype: np.dtype, *, what: str) -> np.ndarray:
    """A (nested) JSON list of numbers as an array of `dtype`; strings, bools, nulls, ragged lists -> 422.

    numpy converts the whole list in C; only the dtype it infers is inspected, so there is
    no per-element Python loop.
    """
    try:
        array = np.asarray(values)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(f"{what} must be a rectangular nested list of numbers: {exc}") from None
    if array.dtype.kind not in "fiu":
        raise InvalidInput(
            f"{what} must hold only numbers; found {'non-numeric values' if array.dtype.kind in 'OUSVb' else array.dtype}"
            f" (numpy saw dtype {array.dtype})"
        )
    with np.errstate(over="ignore"):  # overflow -> Inf, refused later as non-finite
        return array.astype(dtype)


def _json_ready(array: np.ndarray) -> np.ndarray | float:
    # orjson serializes float16/32/64 arrays natively (not 0-d ones); bfloat16 values are exact in float32.
    array = array.astype(np.float32) if array.dtype == BFLOAT16 else np.require(array, requirements="C")
    return array.item() if array.ndim == 0 else array


# ---------------------------------------------------------------- OIP v2 tensors

def decode_oip_tensor(
    datatype: str, shape: Sequence[int], *, data: Any = None, raw: memoryview | bytes | None = None, name: str
) -> np.ndarray:
    """One OIP v2 input tensor, from JSON `data` (flat or nested, row-major) or binary `raw` bytes."""
    dtype = OIP_TO_NP.get(datatype)
    if dtype is None:
        raise InvalidInput(f"input {name!r} datatype must be one of {', '.join(OIP_TO_NP)}; got {datatype!r:.50}")
    shape = _shape_of(list(shape), f"shape of input {name!r}")
    count = _numel(shape)
    if raw is not None:
        needed = count * dtype.itemsize
        if len(raw) != needed:
            raise BadRequest(
                f"input {name!r} has binary_data_size {len(raw)}; shape {list(shape)} {datatype} needs {needed}"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    if data is None:
        raise BadRequest(f"input {name!r} has neither JSON 'data' nor a binary_data_size parameter")
    array = numbers_to_array(data, dtype, what=f"data of input {name!r}")
    if array.size != count:
        raise InvalidInput(f"input {name!r} has {array.size} values; shape {list(shape)} needs {count}")
    return array.reshape(shape)


def oip_datatype(dtype: np.dtype) -> str:
    """OIP datatype name of a float dtype ('FP32', 'BF16', ...)."""
    return NP_TO_OIP[dtype_name(dtype)]


def oip_json_data(array: np.ndarray) -> np.ndarray:
    """Row-major flat data of `array`, ready for orjson (OPT_SERIALIZE_NUMPY)."""
    return _json_ready(array.reshape(-1))


def raw_bytes(array: np.ndarray) -> memoryview:
    """Little-endian row-major bytes of `array` (no copy when already contiguous)."""
    return _little_endian(np.require(array, requirements="C")).reshape(-1).view(np.uint8).data


# ---------------------------------------------------------------- validation

def check_shape(shape: Sequence[int], *, embed_dim: int, max_seq_len: int, max_tokens: int) -> bool:
    """Refuse (422) a shape that is not [batch, seq, E] / [seq, E] or is over the limits.

    Cheap: called before any decoding or compute. Returns True when the request is
    [seq, E] (the reply drops the batch dim again).
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) not in (2, 3):
        raise InvalidInput(f"{INPUT_NAME} must be [batch, seq, {embed_dim}] or [seq, {embed_dim}]; got shape {list(shape)}")
    squeezed = len(shape) == 2
    batch, seq, width = (1, *shape) if squeezed else shape
    if width != embed_dim:
        raise InvalidInput(f"last dimension must be embed_dim={embed_dim}; got shape {list(shape)}")
    if batch == 0 or seq == 0:
        raise InvalidInput(f"{INPUT_NAME} must not be empty; got shape {list(shape)}")
    if seq > max_seq_len:
        raise InvalidInput(f"sequence length {seq} exceeds max_seq_len={max_seq_len}")
    if batch * seq > max_tokens:
        raise InvalidInput(f"batch * seq = {batch * seq} tokens exceeds max_tokens_per_request={max_tokens}")
    return squeezed


def to_model_input(array: np.ndarray) -> np.ndarray:
    """A floating array as contiguous [batch, seq, E] MODEL_DTYPE (adds the batch dim); NaN/Inf -> 422."""
    _check_float(array.dtype)
    x = array[None] if array.ndim == 2 else array
    with np.errstate(over="ignore"):  # float64 beyond float32's range -> Inf, refused just below
        # ALIGNED: a zero-copy view of a body can sit at any byte offset; torch kernels
        # then take different (still correct, but not bitwise-equal) paths.
        x = np.require(x, dtype=MODEL_DTYPE, requirements=["C_CONTIGUOUS", "ALIGNED"])
    if not np.isfinite(x).all():
        raise InvalidInput(f"{INPUT_NAME} contains NaN or Inf (or values that overflow float32)")
    return x


def validate_hidden_states(
    array: np.ndarray, *, embed_dim: int, max_seq_len: int, max_tokens: int
) -> tuple[np.ndarray, bool]:
    """Check an input tensor and bring it to [batch, seq, E] float32.

    Returns (array3d, squeezed) where squeezed says the request was [seq, E] and the
    reply must drop the batch dim again. Raises InvalidInput naming expected vs found.
    """
    _check_float(array.dtype)
    squeezed = check_shape(array.shape, embed_dim=embed_dim, max_seq_len=max_seq_len, max_tokens=max_tokens)
    return to_model_input(array), squeezed


def cast_reply(out: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The model's float32 output in the reply dtype (round-to-nearest-even for half types)."""
    if out.dtype == dtype:
        return out
    with np.errstate(over="ignore"):
        return out.astype(dtype)


# ---------------------------------------------------------------- helpers

def _check_float(dtype: np.dtype) -> None:
    if dtype.kind != "f" and dtype != BFLOAT16:
        raise InvalidInput(
            f"{INPUT_NAME} must be a floating-point tensor ({', '.join(DTYPE_NAMES)}); got dtype {dtype_name(dtype)}"
        )


def _shape_of(shape: Any, what: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > 8 or not all(type(d) is int and d >= 0 for d in shape):
        raise BadRequest(f"{what} must be a list of at most 8 non-negative integers; got {shape!r:.100}")
    return tuple(shape)


def _numel(shape: Sequence[int]) -> int:
    # Python ints: a lying header cannot overflow the product.
    total = 1
    for d in shape:
        total *= int(d)
    return total


def _nbytes(shape: Sequence[int], dtype: np.dtype) -> int:
    return _numel(shape) * dtype.itemsize


def _little_endian(array: np.ndarray) -> np.ndarray:
    if array.dtype.byteorder == ">":
        return array.astype(array.dtype.newbyteorder("<"))
    return array
