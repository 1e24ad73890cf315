"""Tensor wire formats: safetensors, npy, JSON and Open Inference Protocol v2 tensors.

One module, used by every route. Contracts:

- `decode(body, media_type, limits) -> np.ndarray` returns the request tensor in its *wire*
  dtype: float16, bfloat16 (`ml_dtypes.bfloat16`), float32 or float64. Every other dtype
  is refused by name (422) while the header is read, before any data is touched. Binary
  formats are decoded zero-copy: the array is a read-only view of `body`.
- With `limits` (what the serving routes pass), the declared shape (npy / safetensors
  header, JSON `shape`, or the outer lengths of nested JSON lists) is checked against
  `check_shape` *before* any value is converted, and a JSON body is first bounded by size
  (`max_json_bytes`) and by a byte scan (`prescan_json`) that refuses list/object/string
  bombs before they are parsed.
- `encode(array, media_type) -> bytes` writes the reply tensor in the array's dtype.
- `validate_hidden_states` checks shape and limits (`check_shape`, before any compute) and
  converts to the model dtype, float32 (`to_model_input`), refusing NaN/Inf.
- `reply_dtype(request_dtype, override)` is the dtype rule: the reply has the request's
  dtype unless the caller asks for another one (`output_dtype`).

Every malformed input raises BadRequest (400), PayloadTooLarge (413) or InvalidInput
(422) with a message written here (never the text of an internal exception, never more
than a short excerpt of the input). Nothing here ever unpickles: npy headers are parsed
here with `ast.literal_eval` of a size-capped header, and only float descrs are accepted;
safetensors headers are parsed here, with the header length capped and every offset
bounds-checked before any slicing. Large JSON values are converted in chunks of
`JSON_CHUNK_VALUES`, so a decoding thread gives the interpreter lock back between chunks.
"""
from __future__ import annotations

import ast
import io
import re
import reprlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import orjson

from service.errors import BadRequest, InvalidInput, NotAcceptable, PayloadTooLarge, UnsupportedMediaType

SAFETENSORS = "application/x-safetensors"
NPY = "application/x-npy"
JSON = "application/json"
MEDIA_TYPES = (SAFETENSORS, NPY, JSON)

INPUT_NAME = "hidden_states"
OUTPUT_NAME = "output"
MAX_SAFETENSORS_HEADER = 1 << 20  # 1 MiB of JSON header is far more than one tensor needs
NPY_MAGIC = b"\x93NUMPY"
MAX_NPY_HEADER = 10000  # numpy's own default max_header_size
MAX_DIMS = 8  # no accepted tensor has more; numpy itself stops at 64
MAX_DIM = 2**31 - 1
MAX_ELEMENTS_BOUND = 2**48  # product of the non-zero dims: beyond it numpy cannot even describe the array
# JSON bombs: a valid body has a handful of objects, keys and strings. Bounds checked by a
# byte scan before parsing (strings that contain these bytes count too, harmlessly).
MAX_JSON_OBJECTS = 256
MAX_JSON_KEYS = 4096
MAX_JSON_STRINGS = 8192
JSON_CHUNK_VALUES = 1 << 16  # values converted per numpy call (the GIL is released between calls)

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
MODEL_DTYPE = np.dtype(np.float32)
# Floating dtypes accepted on the wire, by their public name (the `dtype` of JSON bodies,
# the `output_dtype` query parameter). All are computed in MODEL_DTYPE. Nothing else is.
FLOAT_DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": BFLOAT16,
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
DTYPE_NAMES = tuple(FLOAT_DTYPES)
_ACCEPTED = f"{INPUT_NAME} must be a floating-point tensor ({', '.join(DTYPE_NAMES)})"

# safetensors dtype codes <-> numpy (the accepted four only).
_ST_TO_NP: dict[str, np.dtype] = {
    "F16": np.dtype("<f2"), "BF16": BFLOAT16, "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
}
_NP_TO_ST = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}

# Open Inference Protocol v2 datatypes (only the floating ones are served).
OIP_TO_NP: dict[str, np.dtype] = {
    "FP16": np.dtype("<f2"), "BF16": BFLOAT16, "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
NP_TO_OIP = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32", "float64": "FP64"}

_NPY_DESCR = re.compile(r"[<>|=]?[A-Za-z]{1,2}[0-9]{0,3}")


@dataclass(frozen=True)
class Limits:
    """What one request may declare; checked before any value is converted."""

    embed_dim: int
    max_seq_len: int
    max_tokens: int
    max_json_bytes: int | None = None

    def check(self, shape: Sequence[int]) -> bool:
        """`check_shape` with these limits; True when the shape is [seq, E]."""
        return check_shape(shape, embed_dim=self.embed_dim, max_seq_len=self.max_seq_len, max_tokens=self.max_tokens)


def dtype_name(dtype: np.dtype) -> str:
    """Public name of a numpy dtype ('bfloat16' for ml_dtypes' bfloat16, else numpy's name)."""
    return "bfloat16" if dtype == BFLOAT16 else np.dtype(dtype).name


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 2, 4, 4, 4
_REPR.maxstring, _REPR.maxlong, _REPR.maxother = 40, 24, 40


def snip(value: Any, limit: int = 80) -> str:
    """A short repr of (untrusted) `value` for an error message (never walks a big container)."""
    try:
        text = _REPR.repr(bytes(value[:limit]) if isinstance(value, (bytes, bytearray, memoryview)) else value)
    except Exception:  # a repr of hostile input must never become the error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- media negotiation

def media_type_of(content_type: str | None) -> str:
    """The request's media type, or UnsupportedMediaType naming the supported ones."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media in MEDIA_TYPES:
        return media
    raise UnsupportedMediaType(
        f"Content-Type {snip(content_type) if content_type else '(none)'} is not supported; "
        f"use one of {', '.join(MEDIA_TYPES)}"
    )


def negotiate(accept: str | None, request_media: str) -> str:
    """Reply media type from Accept; '*/*' or no header means 'same as the request'."""
    if not accept:
        return request_media
    wanted = [part.split(";", 1)[0].strip().lower() for part in accept.split(",")[:32]]
    for media in wanted:
        if media in ("*/*", "application/*", ""):
            return request_media
        if media in MEDIA_TYPES:
            return media
    raise NotAcceptable(f"Accept {snip(accept)} matches none of {', '.join(MEDIA_TYPES)}")


def reply_dtype(request_dtype: np.dtype, override: str | None, media_type: str | None = None) -> np.dtype:
    """The reply's dtype: `override` if given (a FLOAT_DTYPES name), else the request's.

    npy cannot carry bfloat16 (numpy has no such dtype; the file would say 'V2'), so a
    bfloat16 reply in npy is refused with 422 naming the formats that can.
    """
    if override is not None:
        if not isinstance(override, str) or override not in FLOAT_DTYPES:
            raise InvalidInput(f"output_dtype must be one of {', '.join(DTYPE_NAMES)}; got {snip(override)}")
        dtype = FLOAT_DTYPES[override]
    else:
        dtype = np.dtype(request_dtype)
    if media_type == NPY and dtype == BFLOAT16:
        raise InvalidInput("npy cannot carry bfloat16; ask for Accept: application/x-safetensors or application/json")
    return dtype


# ---------------------------------------------------------------- decode / encode

def decode(body: bytes, media_type: str, limits: Limits | None = None) -> np.ndarray:
    """The request tensor of `body` in its wire dtype (see the module docstring)."""
    if not body:
        raise BadRequest("request body is empty")
    if media_type == SAFETENSORS:
        return decode_safetensors(body, limits=limits)
    if media_type == NPY:
        return decode_npy(body, limits=limits)
    if media_type == JSON:
        return decode_json(body, limits=limits)
    raise UnsupportedMediaType(f"no decoder for {snip(media_type)}")


def encode(array: np.ndarray, media_type: str) -> bytes:
    """`array` in `media_type`, keeping its dtype (tensor `output`; JSON adds shape and dtype)."""
    if media_type == SAFETENSORS:
        return encode_safetensors({OUTPUT_NAME: array})
    if media_type == NPY:
        return encode_npy(array)
    if media_type == JSON:
        return encode_json(array)
    raise NotAcceptable(f"no encoder for {snip(media_type)}")


def decode_safetensors(body: bytes, name: str = INPUT_NAME, limits: Limits | None = None) -> np.ndarray:
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
        raise BadRequest(f"safetensors header is not valid JSON (at byte {_json_error_pos(exc)})") from None
    if not isinstance(header, dict):
        raise BadRequest(f"safetensors header must be a JSON object; got {type(header).__name__}")
    if name not in header:
        names = [k for k in header if k != "__metadata__"]
        raise InvalidInput(
            f"safetensors body needs a tensor named {name!r}; found {len(names)}: {snip(sorted(names)[:5])}"
        )
    entry = header[name]
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise BadRequest(f"safetensors entry {name!r} needs dtype, shape and data_offsets; got {snip(entry)}")
    code = entry["dtype"]
    dtype = _ST_TO_NP.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise InvalidInput(
            f"{_ACCEPTED}; safetensors dtype {snip(code)} of {name!r} is not accepted (use F32, F16, BF16 or F64)"
        )
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
            f"got {snip(offsets)}"
        )
    if limits is not None:
        limits.check(shape)
    begin, end = offsets
    needed = _nbytes(shape, dtype)
    if end - begin != needed:
        raise BadRequest(f"safetensors tensor {name!r} spans {end - begin} bytes; shape {list(shape)} {code} needs {needed}")
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


def decode_npy(body: bytes, limits: Limits | None = None) -> np.ndarray:
    """The array of an npy body (zero-copy). Only float16/32/64 descrs are accepted.

    The header (format 1.0, 2.0 or 3.0) is parsed here, never by numpy's loader: its
    size is capped (MAX_NPY_HEADER), it is read with `ast.literal_eval` (no code, no
    pickles), and every field is type-checked before it is used.
    """
    view = memoryview(body)
    if len(view) < 10 or bytes(view[:6]) != NPY_MAGIC:
        raise BadRequest(f"npy body must start with the magic {NPY_MAGIC!r}; got {snip(view[:8])}")
    major, minor = view[6], view[7]
    if (major, minor) not in ((1, 0), (2, 0), (3, 0)):
        raise BadRequest(f"npy format version {major}.{minor} is not supported (1.0, 2.0 or 3.0)")
    if major == 1:
        (header_len,), start = struct.unpack_from("<H", view, 8), 10
    elif len(view) >= 12:
        (header_len,), start = struct.unpack_from("<I", view, 8), 12
    else:
        raise BadRequest(f"npy body is {len(view)} bytes; format {major}.0 needs a 4-byte header length")
    if header_len > MAX_NPY_HEADER or start + header_len > len(view):
        raise BadRequest(
            f"npy header claims {header_len} bytes; the body has {len(view) - start} after the length "
            f"(limit {MAX_NPY_HEADER})"
        )
    try:
        text = bytes(view[start:start + header_len]).decode("utf-8" if major == 3 else "latin-1")
        header = ast.literal_eval(text)
    except Exception:  # SyntaxError, ValueError, RecursionError, MemoryError, ...: all mean "not a header"
        raise BadRequest("invalid npy header: not a Python dict literal") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        found = sorted(map(str, header))[:5] if isinstance(header, dict) else type(header).__name__
        raise BadRequest(f"invalid npy header: needs exactly the keys descr, fortran_order, shape; got {snip(found)}")
    fortran = header["fortran_order"]
    if type(fortran) is not bool:
        raise BadRequest(f"invalid npy header: fortran_order must be True or False; got {snip(fortran)}")
    if not isinstance(header["shape"], tuple):
        raise BadRequest(f"invalid npy header: shape must be a tuple; got {snip(header['shape'])}")
    shape = _shape_of(list(header["shape"]), "npy shape")
    dtype = _npy_dtype(header["descr"])
    if limits is not None:
        limits.check(shape)
    expected = _nbytes(shape, dtype)
    data = view[start + header_len:]
    if len(data) != expected:
        raise BadRequest(f"npy data is {len(data)} bytes; header {list(shape)} {dtype_name(dtype)} needs {expected}")
    array = np.frombuffer(data, dtype=dtype)
    return array.reshape(shape[::-1]).T if fortran else array.reshape(shape)


def _npy_dtype(descr: Any) -> np.dtype:
    """An accepted float dtype from an npy descr, or InvalidInput naming what was found."""
    if not isinstance(descr, str):
        raise InvalidInput(f"{_ACCEPTED}; npy descr {snip(descr)} is a structured or subarray dtype")
    if not _NPY_DESCR.fullmatch(descr):
        raise InvalidInput(f"{_ACCEPTED}; npy descr {snip(descr)} is not accepted")
    try:
        dtype = np.dtype(descr)
    except Exception:
        raise InvalidInput(f"{_ACCEPTED}; npy descr {snip(descr)} is not a numpy dtype") from None
    if dtype.hasobject:
        raise InvalidInput("npy body holds Python objects (pickled data); only numeric arrays are accepted")
    if dtype.kind == "f" and dtype.itemsize in (2, 4, 8) and dtype.fields is None and dtype.subdtype is None:
        return dtype
    note = " (npy cannot carry bfloat16: numpy writes it as raw V2; use safetensors or JSON)" if descr.endswith("V2") else ""
    raise InvalidInput(f"{_ACCEPTED}; got npy dtype {dtype.name} ({descr}){note}")


def encode_npy(array: np.ndarray) -> bytes:
    """npy v1 bytes of `array` (header + one copy of the data)."""
    if array.dtype == BFLOAT16:
        raise InvalidInput("npy cannot carry bfloat16; use safetensors or JSON")
    array = np.require(array, requirements="C")  # (ascontiguousarray would make 0-d arrays 1-d)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    return b"".join([header.getvalue(), array.reshape(-1).view(np.uint8).data])


# ---------------------------------------------------------------- JSON

def loads_json(body: bytes | memoryview, limits: Limits | None = None, *, what: str = "JSON body") -> Any:
    """Parse a JSON body after bounding it: max_json_bytes (413), then `prescan_json` (422)."""
    if limits is not None:
        if limits.max_json_bytes is not None and len(body) > limits.max_json_bytes:
            raise PayloadTooLarge(f"{what} is {len(body)} bytes; the limit is max_json_bytes={limits.max_json_bytes}")
        prescan_json(body, limits.embed_dim, what=what)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON in the {what} at byte {_json_error_pos(exc)}") from None


def prescan_json(body: bytes | memoryview, embed_dim: int, *, what: str = "JSON body") -> None:
    """Refuse, by counting bytes (C speed, before parsing), JSON that cannot be a tensor request
    but would cost far more to parse and convert than its size suggests: millions of empty
    lists, objects, keys or strings.

    A tensor of width E nested as lists has at most 2 lists per E numbers (one per row,
    one per batch entry, plus the outer one); its numbers are separated by commas, so
    `lists <= 2 * (commas + 1) / (E - 1) + slack` holds for every valid body.
    """
    data = body if isinstance(body, bytes) else bytes(body)
    lists, commas = data.count(b"["), data.count(b",")
    allowed_lists = 2 * (commas + 1) // max(embed_dim - 1, 1) + 16
    if lists > allowed_lists:
        raise InvalidInput(
            f"the {what} has {lists} JSON lists for at most {commas + 1} values; a tensor of width "
            f"embed_dim={embed_dim} nests at most {allowed_lists}"
        )
    for char, limit, kind in ((b"{", MAX_JSON_OBJECTS, "objects"), (b":", MAX_JSON_KEYS, "keys"),
                              (b'"', 2 * MAX_JSON_STRINGS, "strings")):
        count = data.count(char)
        if count > limit:
            raise InvalidInput(f"the {what} has too many JSON {kind} ({count} '{char.decode()}' > {limit})")


def decode_json(body: bytes, limits: Limits | None = None) -> np.ndarray:
    """`{"hidden_states": nested lists, "dtype"?: "float32"|"float16"|"bfloat16"|"float64", "shape"?: [...]}`.

    Values are cast to `dtype` (default float32): the request's dtype, which the reply
    keeps. Values out of that dtype's range become Inf and are refused by validation.
    With `shape`, the values (nested or flat, row-major) are reshaped to it. With
    `limits`, the shape (declared, or the nested lists' outer lengths) is checked before
    any value is converted.
    """
    doc = loads_json(body, limits)
    if not isinstance(doc, dict) or INPUT_NAME not in doc:
        found = sorted(doc)[:10] if isinstance(doc, dict) else type(doc).__name__
        raise InvalidInput(f'JSON body must be an object {{"{INPUT_NAME}": [[...], ...]}}; found {snip(found)}')
    name = doc.get("dtype", "float32")
    if not isinstance(name, str) or name not in FLOAT_DTYPES:
        raise InvalidInput(f"JSON dtype must be one of {', '.join(DTYPE_NAMES)}; got {snip(name)}")
    shape = None if doc.get("shape") is None else _shape_of(doc["shape"], "JSON shape")
    return numbers_to_array(doc[INPUT_NAME], FLOAT_DTYPES[name], what=INPUT_NAME, shape=shape, limits=limits)


def encode_json(array: np.ndarray, name: str = OUTPUT_NAME) -> bytes:
    """`{name: nested lists, "shape": [...], "dtype": dtype name}`, serialized by orjson from numpy
    (in chunks: see `json_values`).

    With name="hidden_states" it is a valid request body (decode_json ignores "shape").
    """
    payload = {name: json_values(array), "shape": list(array.shape), "dtype": dtype_name(array.dtype)}
    return orjson.dumps(payload)


def json_values(array: np.ndarray) -> orjson.Fragment:
    """`array` as nested JSON lists, serialized in pieces of at most JSON_CHUNK_VALUES
    values (each one orjson call, so a serializing thread lets others run in between)."""
    array = array.astype(np.float32) if array.dtype == BFLOAT16 else np.require(array, requirements="C")
    return orjson.Fragment(_dump_values(array))


def _dump_values(array: np.ndarray) -> bytes:
    if array.ndim == 0:
        return orjson.dumps(array.item())
    if array.size <= JSON_CHUNK_VALUES:
        return orjson.dumps(array, option=orjson.OPT_SERIALIZE_NUMPY)
    if array.ndim > 1:
        return b"[" + b",".join(_dump_values(sub) for sub in array) + b"]"
    parts = (orjson.dumps(array[i:i + JSON_CHUNK_VALUES], option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]
             for i in range(0, len(array), JSON_CHUNK_VALUES))
    return b"[" + b",".join(parts) + b"]"


def numbers_to_array(
    values: Any, dtype: np.dtype, *, what: str, shape: Sequence[int] | None = None, limits: Limits | None = None
) -> np.ndarray:
    """A (nested) JSON list of numbers as an array of `dtype` (reshaped to `shape` if given);
    strings, bools, nulls, ragged lists -> 422.

    Before any value is converted: the nesting's outer lengths give the array's shape,
    which must match `shape`'s element count and pass `limits`. Then the innermost lists
    are converted by numpy (in C) a chunk at a time; only the dtype numpy infers for a
    chunk is inspected, so there is no per-element Python loop.
    """
    nested = _nesting(values, what)
    target = tuple(nested) if shape is None else tuple(shape)
    if limits is not None:
        limits.check(target)
    count = _numel(nested)
    if shape is not None and count != _numel(shape):
        found = f"{count} values" if len(nested) <= 1 else f"{count} values (nested as {list(nested)})"
        raise InvalidInput(f"{what} has {found}; shape {list(shape)} needs {_numel(shape)}")
    if not nested:  # a bare number
        if type(values) not in (int, float):
            raise InvalidInput(f"{what} must hold only numbers; found {type(values).__name__}")
        return _cast_numbers(np.asarray(values), dtype, what).reshape(target)
    rows = _innermost_lists(values, nested, what)  # count / width lists of `width` values each
    out = np.empty(count, dtype=dtype)
    width = nested[-1]
    if count and width <= JSON_CHUNK_VALUES:
        per_chunk = JSON_CHUNK_VALUES // width
        for i in range(0, len(rows), per_chunk):
            chunk = rows[i:i + per_chunk]
            out[i * width:(i + len(chunk)) * width] = _chunk_to_array(chunk, (len(chunk), width), dtype, what)
    elif count:  # long rows (flat data): slices of each
        for r, row in enumerate(rows):
            for j in range(0, width, JSON_CHUNK_VALUES):
                piece = row[j:j + JSON_CHUNK_VALUES]
                out[r * width + j:r * width + j + len(piece)] = _chunk_to_array(piece, (len(piece),), dtype, what)
    return out.reshape(target)


def _chunk_to_array(chunk: list, shape: tuple[int, ...], dtype: np.dtype, what: str) -> np.ndarray:
    """One chunk of lists of numbers as a flat array of `dtype` (one numpy call)."""
    try:
        part = np.asarray(chunk)
    except (ValueError, TypeError, OverflowError):
        raise InvalidInput(f"{what} must be a rectangular nested list of numbers") from None
    if part.shape != shape:
        raise InvalidInput(f"{what} must be a rectangular nested list of numbers (found lists inside the innermost lists)")
    return _cast_numbers(part, dtype, what).reshape(-1)


def _cast_numbers(part: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    if part.dtype.kind not in "fiu":
        found = "non-numeric values" if part.dtype.kind in "OUSVb" else dtype_name(part.dtype)
        raise InvalidInput(f"{what} must hold only numbers; found {found} (numpy saw dtype {part.dtype.kind})")
    with np.errstate(over="ignore"):  # overflow -> Inf, refused later as non-finite
        return part.astype(dtype)


def _nesting(values: Any, what: str) -> tuple[int, ...]:
    """Lengths of the first list at each nesting level (O(depth); nothing is converted)."""
    lengths = []
    node = values
    while type(node) is list:
        lengths.append(len(node))
        if len(lengths) > MAX_DIMS:
            raise InvalidInput(f"{what} is nested more than {MAX_DIMS} lists deep")
        if not node:
            break
        node = node[0]
    _check_dims(lengths, what)
    return tuple(lengths)


def _innermost_lists(values: list, nested: tuple[int, ...], what: str) -> list:
    """The innermost lists in row-major order, every level's length checked on the way
    (a Python loop over the lists only, never over the numbers)."""
    level = [values]
    for depth, length in enumerate(nested):
        for item in level:
            if type(item) is not list or len(item) != length:
                raise InvalidInput(f"{what} must be a rectangular nested list of numbers "
                                   f"(every list at depth {depth} should have {length} entries; nested as {list(nested)})")
        if depth < len(nested) - 1:
            level = [inner for item in level for inner in item]
    return level


def _json_error_pos(exc: orjson.JSONDecodeError) -> int:
    return int(getattr(exc, "pos", -1) or 0)


# ---------------------------------------------------------------- OIP v2 tensors

def decode_oip_tensor(
    datatype: str, shape: Sequence[int], *, data: Any = None, raw: memoryview | bytes | None = None, name: str,
    limits: Limits | None = None,
) -> np.ndarray:
    """One OIP v2 input tensor, from JSON `data` (flat or nested, row-major) or binary `raw` bytes."""
    dtype = OIP_TO_NP.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise InvalidInput(f"input {snip(name)} datatype must be one of {', '.join(OIP_TO_NP)}; got {snip(datatype)}")
    shape = _shape_of(list(shape), f"shape of input {snip(name)}")
    if limits is not None:
        limits.check(shape)
    count = _numel(shape)
    if raw is not None:
        needed = count * dtype.itemsize
        if len(raw) != needed:
            raise BadRequest(
                f"input {snip(name)} has binary_data_size {len(raw)}; shape {list(shape)} {datatype} needs {needed}"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    if data is None:
        raise BadRequest(f"input {snip(name)} has neither JSON 'data' nor a binary_data_size parameter")
    return numbers_to_array(data, dtype, what=f"data of input {snip(name)}", shape=shape)


def oip_datatype(dtype: np.dtype) -> str:
    """OIP datatype name of a float dtype ('FP32', 'BF16', ...)."""
    return NP_TO_OIP[dtype_name(dtype)]


def oip_json_data(array: np.ndarray) -> np.ndarray | float:
    """Row-major flat data of `array`, ready for orjson (OPT_SERIALIZE_NUMPY); the reply
    route serializes it in chunks with `json_values(array.reshape(-1))`."""
    array = array.astype(np.float32) if array.dtype == BFLOAT16 else np.require(array, requirements="C")
    return array.reshape(-1)


def raw_bytes(array: np.ndarray) -> memoryview:
    """Little-endian row-major bytes of `array` (no copy when already contiguous)."""
    return _little_endian(np.require(array, requirements="C")).reshape(-1).view(np.uint8).data


# ---------------------------------------------------------------- validation

def check_shape(shape: Sequence[int], *, embed_dim: int, max_seq_len: int, max_tokens: int) -> bool:
    """Refuse (422) a shape that is not [batch, seq, E] / [seq, E] or is over the limits.

    Cheap: called before any decoding or compute. Returns True when the request is
    [seq, E] (the reply drops the batch dim again).
    """
    if len(shape) not in (2, 3):
        raise InvalidInput(
            f"{INPUT_NAME} must be [batch, seq, {embed_dim}] or [seq, {embed_dim}]; got shape {snip(list(shape))}"
        )
    shape = tuple(int(d) for d in shape)
    squeezed = len(shape) == 2
    batch, seq, width = (1, *shape) if squeezed else shape
    if width != embed_dim:
        raise InvalidInput(f"last dimension must be embed_dim={embed_dim}; got shape {snip(list(shape))}")
    if batch <= 0 or seq <= 0:
        raise InvalidInput(f"{INPUT_NAME} must not be empty; got shape {snip(list(shape))}")
    if seq > max_seq_len:
        raise InvalidInput(f"sequence length {snip(seq)} exceeds max_seq_len={max_seq_len}")
    if batch * seq > max_tokens:
        raise InvalidInput(f"batch * seq = {snip(batch * seq)} tokens exceeds max_tokens_per_request={max_tokens}")
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
    if dtype_name(dtype) not in FLOAT_DTYPES:
        raise InvalidInput(f"{_ACCEPTED}; got dtype {dtype_name(dtype)}")


def _shape_of(shape: Any, what: str) -> tuple[int, ...]:
    """A declared shape: a list of at most MAX_DIMS non-negative ints (400 if not even that)."""
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape[:MAX_DIMS + 1]):
        raise BadRequest(f"{what} must be at most {MAX_DIMS} non-negative integers; got {snip(shape)}")
    _check_dims(shape, what)
    return tuple(shape)


def _check_dims(shape: Sequence[int], what: str) -> None:
    if len(shape) > MAX_DIMS:
        raise InvalidInput(f"{what} has {len(shape)} dimensions; at most {MAX_DIMS} are accepted")
    bound = 1
    for d in shape:
        bound *= max(int(d), 1)
    if any(d > MAX_DIM for d in shape) or bound > MAX_ELEMENTS_BOUND:
        raise InvalidInput(f"{what} {snip(list(shape))} is far too large")


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
