"""Tensor wire formats of the gangserve HTTP API: safetensors, npy and JSON.

The one implementation of these formats: the client encodes requests and decodes replies
with it, and the service (`service.ingress.codecs`) decodes requests and encodes replies with it,
adding its own limits, negotiation and validation on top. Pure numpy (+ orjson for JSON);
bfloat16 needs `ml_dtypes` (`pip install 'gangserve-client[bfloat16]'`; the service
always has it).

Contracts:

- Decoders return the tensor in its *wire* dtype: float16, bfloat16 (`ml_dtypes.bfloat16`),
  float32 or float64. Every other dtype is refused by name while the header is read,
  before any data is touched. Binary formats are decoded zero-copy: the array is a
  read-only view of the body.
- Every decoder takes an optional `check(shape)` callable, called with the declared shape
  (npy / safetensors header, JSON `shape` or the outer lengths of nested JSON lists)
  *before* any value is converted: the service passes its shape limits there.
- Encoders write an array in its own dtype.
- Errors are `WireFormatError` subclasses with a message written here (never the text of
  an internal exception, never more than a short excerpt of the input, at most
  `MAX_MESSAGE_CHARS`): `MalformedError` (the bytes are not a valid body of the format;
  the service answers 400), `InvalidTensorError` (parsed, but not a tensor the API
  carries: dtype, name, nesting, values; 422) and `UnencodableError` (an array the format
  cannot write; 406).

Nothing here ever unpickles: npy headers are parsed here, as a literal only (`_Literal`), from a
size-capped header, and only float descrs are accepted; safetensors headers are parsed
here, with the header length capped and every offset bounds-checked before any slicing.
Large JSON values are converted and serialized in chunks of `JSON_CHUNK_VALUES`, so a
thread doing it gives the interpreter lock back between chunks.
"""
from __future__ import annotations

import io
import re
import reprlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson

try:  # the `bfloat16` extra
    import ml_dtypes
except ImportError:  # pragma: no cover - exercised by the fresh-venv test (tests/test_client_dist.py)
    ml_dtypes = None

SAFETENSORS = "application/x-safetensors"
NPY = "application/x-npy"
JSON = "application/json"
MEDIA_TYPES = (SAFETENSORS, NPY, JSON)

INPUT_NAME = "hidden_states"
MASK_NAME = "attention_mask"  # optional key padding mask next to hidden_states: 1 = token, 0 = padding
OUTPUT_NAME = "output"
MAX_MESSAGE_CHARS = 1000
MAX_SAFETENSORS_HEADER = 1 << 20  # 1 MiB of JSON header is far more than one tensor needs
NPY_MAGIC = b"\x93NUMPY"
MAX_NPY_HEADER = 10000  # numpy's own default max_header_size
MAX_DIMS = 8  # no accepted tensor has more; numpy itself stops at 64
MAX_DIM = 2**31 - 1
MAX_ELEMENTS_BOUND = 2**48  # product of the non-zero dims: beyond it numpy cannot even describe the array
JSON_CHUNK_VALUES = 1 << 16  # values converted or serialized per numpy/orjson call

BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16) if ml_dtypes is not None else None
# Floating dtypes accepted on the wire, by their public name (the `dtype` of JSON bodies,
# the `output_dtype` query parameter). Nothing else is. "bfloat16" is always a wire name;
# it has a numpy dtype only with ml_dtypes (see `float_dtype`).
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
FLOAT_DTYPES: dict[str, np.dtype] = {
    name: (BFLOAT16 if name == "bfloat16" else np.dtype(name))
    for name in DTYPE_NAMES if name != "bfloat16" or BFLOAT16 is not None
}
ACCEPTED = f"{INPUT_NAME} must be a floating-point tensor ({', '.join(DTYPE_NAMES)})"
BFLOAT16_EXTRA = "bfloat16 needs ml_dtypes: pip install 'gangserve-client[bfloat16]'"

# safetensors dtype codes <-> wire dtype names: F64 (float64), F32, F16 and BF16; no others.
_ST_TO_NP: dict[str, np.dtype | None] = {
    "F16": np.dtype("<f2"), "BF16": BFLOAT16, "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
}
_NP_TO_ST = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}
# The attention mask's safetensors dtypes (an integer or boolean tensor; values 0/1).
_ST_MASK_TO_NP: dict[str, np.dtype] = {
    "BOOL": np.dtype(bool), "U8": np.dtype("u1"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8"),
}
_NP_MASK_TO_ST = {"bool": "BOOL", "uint8": "U8", "int32": "I32", "int64": "I64"}

_NPY_DESCR = re.compile(r"[<>|=]?[A-Za-z]{1,2}[0-9]{0,3}")

ShapeCheck = Callable[[tuple[int, ...]], object]


# ---------------------------------------------------------------- errors

class WireFormatError(ValueError):
    """A body or array the wire formats cannot carry; `message` is bounded and written here."""

    def __init__(self, message: str) -> None:
        message = str(message)
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        super().__init__(message)
        self.message = message


class MalformedError(WireFormatError):
    """The bytes are not a valid body of the format (the service answers 400 malformed)."""


class InvalidTensorError(WireFormatError):
    """Parsed, but not a tensor the API carries: dtype, name, nesting or values (422)."""


class UnencodableError(WireFormatError):
    """An array the format cannot write (the service answers 406)."""


# ---------------------------------------------------------------- dtypes

def is_bfloat16(dtype: Any) -> bool:
    return BFLOAT16 is not None and np.dtype(dtype) == BFLOAT16


def dtype_name(dtype: Any) -> str:
    """Public name of a numpy dtype ('bfloat16' for ml_dtypes' bfloat16, else numpy's name)."""
    return "bfloat16" if is_bfloat16(dtype) else np.dtype(dtype).name


def float_dtype(name: Any, what: str = "dtype") -> np.dtype:
    """The numpy dtype of a wire dtype name; InvalidTensorError naming the accepted ones."""
    if not isinstance(name, str) or name not in DTYPE_NAMES:
        raise InvalidTensorError(f"{what} must be one of {', '.join(DTYPE_NAMES)}; got {snip(name)}")
    if name not in FLOAT_DTYPES:
        raise InvalidTensorError(f"{what} is bfloat16; {BFLOAT16_EXTRA}")
    return FLOAT_DTYPES[name]


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


# ---------------------------------------------------------------- safetensors

def safetensors_header(body: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """(header, header length) of a safetensors body; the header is a JSON object.

    Layout: u64 little-endian header length N, N bytes of JSON header
    {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}?},
    then the data buffer; offsets are relative to the buffer's start.
    """
    view = memoryview(body)
    if len(view) < 8:
        raise MalformedError(f"safetensors body is {len(view)} bytes; it needs at least an 8-byte header length")
    (header_len,) = struct.unpack_from("<Q", view, 0)
    if header_len > MAX_SAFETENSORS_HEADER or 8 + header_len > len(view):
        raise MalformedError(
            f"safetensors header claims {header_len} bytes; body has {len(view) - 8} after the length "
            f"(limit {MAX_SAFETENSORS_HEADER})"
        )
    try:
        header = orjson.loads(view[8:8 + header_len])
    except orjson.JSONDecodeError as exc:
        raise MalformedError(f"safetensors header is not valid JSON (at byte {_json_error_pos(exc)})") from None
    if not isinstance(header, dict):
        raise MalformedError(f"safetensors header must be a JSON object; got {type(header).__name__}")
    return header, header_len


def safetensors_names(body: bytes | memoryview) -> list[str]:
    """The tensor names of a safetensors body (its header only is read)."""
    header, _ = safetensors_header(body)
    return [name for name in header if name != "__metadata__"]


def decode_safetensors(body: bytes | memoryview, name: str = INPUT_NAME, check: ShapeCheck | None = None) -> np.ndarray:
    """Tensor `name` of a safetensors body, as a zero-copy view of `body`."""
    view = memoryview(body)
    header, header_len = safetensors_header(view)
    if name not in header:
        names = [k for k in header if k != "__metadata__"]
        raise InvalidTensorError(
            f"safetensors body needs a tensor named {name!r}; found {len(names)}: {snip(sorted(names)[:5])}"
        )
    return _safetensors_tensor(view, header, header_len, name, _ST_TO_NP, ACCEPTED + ";", "F32, F16, BF16 or F64", check)


def decode_safetensors_mask(body: bytes | memoryview, name: str = MASK_NAME) -> np.ndarray | None:
    """The optional integer/boolean tensor `name` (BOOL, U8, I32 or I64) of a safetensors body,
    zero-copy; None when the body has none. Its values and shape are the caller's to check."""
    view = memoryview(body)
    header, header_len = safetensors_header(view)
    if name not in header:
        return None
    return _safetensors_tensor(view, header, header_len, name, _ST_MASK_TO_NP, f"{name} must be 0/1 integers or booleans;",
                               "BOOL, U8, I32 or I64", None)


def _safetensors_tensor(
    view: memoryview, header: dict[str, Any], header_len: int, name: str, dtypes: dict[str, np.dtype | None],
    accepted: str, codes: str, check: ShapeCheck | None,
) -> np.ndarray:
    entry = header[name]
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise MalformedError(f"safetensors entry {name!r} needs dtype, shape and data_offsets; got {snip(entry)}")
    code = entry["dtype"]
    if not isinstance(code, str) or code not in dtypes:
        raise InvalidTensorError(f"{accepted} safetensors dtype {snip(code)} of {name!r} is not accepted (use {codes})")
    dtype = dtypes[code]
    if dtype is None:
        raise InvalidTensorError(f"safetensors tensor {name!r} is BF16; {BFLOAT16_EXTRA}")
    shape = shape_of(entry["shape"], f"safetensors shape of {name!r}")
    offsets = entry["data_offsets"]
    buffer_len = len(view) - 8 - header_len
    if (
        not isinstance(offsets, list) or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= buffer_len
    ):
        raise MalformedError(
            f"safetensors data_offsets of {name!r} must be [begin, end] within the {buffer_len}-byte buffer; "
            f"got {snip(offsets)}"
        )
    if check is not None:
        check(shape)
    begin, end = offsets
    needed = nbytes(shape, dtype)
    if end - begin != needed:
        raise MalformedError(
            f"safetensors tensor {name!r} spans {end - begin} bytes; shape {list(shape)} {code} needs {needed}"
        )
    start = 8 + header_len + begin
    return np.frombuffer(view[start:start + needed], dtype=dtype).reshape(shape)


def encode_safetensors(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file of float tensors, and BOOL/U8/I32/I64 masks (`attention_mask`, or a
    name ending in `_attention_mask`, as a dataset's `val_attention_mask`); the header padded
    to 8 bytes, as the library does."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    arrays = []
    offset = 0
    for name, array in tensors.items():
        array = little_endian(np.require(array, requirements="C"))
        is_mask = name == MASK_NAME or name.endswith("_" + MASK_NAME)
        codes = _NP_MASK_TO_ST if is_mask else _NP_TO_ST  # integers only for masks
        code = codes.get(dtype_name(array.dtype))
        if code is None:
            raise UnencodableError(f"cannot write dtype {array.dtype} as safetensors tensor {name!r}; only {', '.join(codes)}")
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    text = orjson.dumps(header)
    text += b" " * (-len(text) % 8)
    # One copy of the data, straight into the body.
    return b"".join([struct.pack("<Q", len(text)), text, *(a.reshape(-1).view(np.uint8).data for a in arrays)])


# ---------------------------------------------------------------- npy

# The npy header is a Python literal (numpy writes `{'descr': '<f4', 'fortran_order': False,
# 'shape': (1, 4, 512), }`). It is read by this small parser, never by `ast`: in CPython 3.11 the
# AST builder keeps its recursion depth in one per-interpreter counter, so an `ast.literal_eval`
# racing any other thread's `ast.parse` (the traceback module calls it to place its carets, in
# whichever thread formats an exception) fails with "SystemError: AST constructor recursion depth
# mismatch" on a valid header: a client's correct request answered 400 (bench/NOTES.md, issue 44).
_LITERAL_TOKEN = re.compile(r"""\s*(?:(?P<punct>[{}()\[\],:])|'(?P<sq>[^'\\\n]*)'|"(?P<dq>[^"\\\n]*)"|(?P<int>[-+]?[0-9]+)(?![0-9.eEjJ])|(?P<name>True|False|None)\b)""")
_NAMES: dict[str, Any] = {"True": True, "False": False, "None": None}
_MAX_LITERAL_DEPTH = 8  # a header nests three deep (dict, descr list, subarray tuple)


class _Literal:
    """A Python literal of strings (no escapes), ints, True/False/None, tuples, lists and dicts:
    the whole grammar of an npy header. Anything else (an expression, a float, an escape,
    nesting past _MAX_LITERAL_DEPTH) is a ValueError."""

    def __init__(self, text: str) -> None:
        self._text, self._at = text, 0

    def parse(self) -> Any:
        value = self._value(0)
        if self._text[self._at:].strip():
            raise ValueError(f"unexpected text at {self._at}")
        return value

    def _token(self) -> re.Match[str]:
        match = _LITERAL_TOKEN.match(self._text, self._at)
        if match is None:
            raise ValueError(f"not a literal at {self._at}")
        self._at = match.end()
        return match

    def _peek(self, punct: str) -> bool:
        match = _LITERAL_TOKEN.match(self._text, self._at)
        if match is not None and match.group("punct") == punct:
            self._at = match.end()
            return True
        return False

    def _value(self, depth: int) -> Any:
        if depth > _MAX_LITERAL_DEPTH:
            raise ValueError("nested too deep")
        token = self._token()
        kind, text = token.lastgroup, token.group(token.lastgroup or 0)
        if kind in ("sq", "dq"):
            return text
        if kind == "int":
            if len(text) > 40:
                raise ValueError("integer too long")
            return int(text)
        if kind == "name":
            return _NAMES[text]
        closing = {"(": ")", "[": "]", "{": "}"}.get(text)
        if closing is None:
            raise ValueError(f"unexpected {text!r} at {token.start()}")
        items: list[Any] = []
        pairs: dict[Any, Any] = {}
        comma = False  # the last item was followed by a comma
        while not self._peek(closing):
            if closing == "}":
                key = self._value(depth + 1)
                if not self._peek(":"):
                    raise ValueError(f"a dict key without ':' at {self._at}")
                pairs[key] = self._value(depth + 1)
            else:
                items.append(self._value(depth + 1))
            comma = self._peek(",")
            if not comma:
                if not self._peek(closing):
                    raise ValueError(f"expected ',' or {closing!r} at {self._at}")
                break
        if closing == "}":
            return pairs
        if closing == ")" and len(items) == 1 and not comma:
            return items[0]  # `(5)` is 5, `(5,)` a tuple
        return tuple(items) if closing == ")" else items

def decode_npy(body: bytes | memoryview, check: ShapeCheck | None = None) -> np.ndarray:
    """The array of an npy body (zero-copy). Only float16/32/64 descrs are accepted.

    The header (format 1.0, 2.0 or 3.0) is parsed here, never by numpy's loader: its
    size is capped (MAX_NPY_HEADER), it is read by `_Literal` (a literal only: no code, no
    pickles, no `ast`), and every field is type-checked before it is used.
    """
    view = memoryview(body)
    if len(view) < 10 or bytes(view[:6]) != NPY_MAGIC:
        raise MalformedError(f"npy body must start with the magic {NPY_MAGIC!r}; got {snip(view[:8])}")
    major, minor = view[6], view[7]
    if (major, minor) not in ((1, 0), (2, 0), (3, 0)):
        raise MalformedError(f"npy format version {major}.{minor} is not supported (1.0, 2.0 or 3.0)")
    if major == 1:
        (header_len,), start = struct.unpack_from("<H", view, 8), 10
    elif len(view) >= 12:
        (header_len,), start = struct.unpack_from("<I", view, 8), 12
    else:
        raise MalformedError(f"npy body is {len(view)} bytes; format {major}.0 needs a 4-byte header length")
    if header_len > MAX_NPY_HEADER or start + header_len > len(view):
        raise MalformedError(
            f"npy header claims {header_len} bytes; the body has {len(view) - start} after the length "
            f"(limit {MAX_NPY_HEADER})"
        )
    raw = bytes(view[start:start + header_len])
    try:
        header = _Literal(raw.decode("utf-8" if major == 3 else "latin-1")).parse()
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedError(f"invalid npy header: not a Python dict literal ({exc}); got {snip(raw)}") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        found = sorted(map(str, header))[:5] if isinstance(header, dict) else type(header).__name__
        raise MalformedError(
            f"invalid npy header: needs exactly the keys descr, fortran_order, shape; got {snip(found)}"
        )
    fortran = header["fortran_order"]
    if type(fortran) is not bool:
        raise MalformedError(f"invalid npy header: fortran_order must be True or False; got {snip(fortran)}")
    if not isinstance(header["shape"], tuple):
        raise MalformedError(f"invalid npy header: shape must be a tuple; got {snip(header['shape'])}")
    shape = shape_of(list(header["shape"]), "npy shape")
    dtype = _npy_dtype(header["descr"])
    if check is not None:
        check(shape)
    expected = nbytes(shape, dtype)
    data = view[start + header_len:]
    if len(data) != expected:
        raise MalformedError(
            f"npy data is {len(data)} bytes; header {list(shape)} {dtype_name(dtype)} needs {expected}"
        )
    array = np.frombuffer(data, dtype=dtype)
    return array.reshape(shape[::-1]).T if fortran else array.reshape(shape)


def _npy_dtype(descr: Any) -> np.dtype:
    """An accepted float dtype from an npy descr, or InvalidTensorError naming what was found."""
    if not isinstance(descr, str):
        raise InvalidTensorError(f"{ACCEPTED}; npy descr {snip(descr)} is a structured or subarray dtype")
    if not _NPY_DESCR.fullmatch(descr):
        raise InvalidTensorError(f"{ACCEPTED}; npy descr {snip(descr)} is not accepted")
    try:
        dtype = np.dtype(descr)
    except Exception:
        raise InvalidTensorError(f"{ACCEPTED}; npy descr {snip(descr)} is not a numpy dtype") from None
    if dtype.hasobject:
        raise InvalidTensorError("npy body holds Python objects (pickled data); only numeric arrays are accepted")
    if dtype.kind == "f" and dtype.itemsize in (2, 4, 8) and dtype.fields is None and dtype.subdtype is None:
        return dtype
    note = (" (npy cannot carry bfloat16: numpy writes it as raw V2; use safetensors or JSON)"
            if descr.endswith("V2") else "")
    raise InvalidTensorError(f"{ACCEPTED}; got npy dtype {dtype.name} ({descr}){note}")


def encode_npy(array: np.ndarray) -> bytes:
    """npy v1 bytes of `array` (header + one copy of the data)."""
    if is_bfloat16(array.dtype):
        raise InvalidTensorError("npy cannot carry bfloat16; use safetensors or JSON")
    array = np.require(array, requirements="C")  # (ascontiguousarray would make 0-d arrays 1-d)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    return b"".join([header.getvalue(), array.reshape(-1).view(np.uint8).data])


# ---------------------------------------------------------------- JSON

def loads_json(body: bytes | memoryview, *, what: str = "JSON body") -> Any:
    """Parse JSON (orjson: no NaN literals, bounded nesting); MalformedError naming the byte."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedError(f"invalid JSON in the {what} at byte {_json_error_pos(exc)}") from None


def decode_json(body: bytes | memoryview, name: str = INPUT_NAME, check: ShapeCheck | None = None) -> np.ndarray:
    """The tensor of a JSON body: see `tensor_from_json`."""
    return tensor_from_json(loads_json(body), name, check=check)


def tensor_from_json(doc: Any, name: str = INPUT_NAME, check: ShapeCheck | None = None) -> np.ndarray:
    """`{name: nested lists, "dtype"?: "float32"|"float16"|"bfloat16"|"float64", "shape"?: [...]}`.

    Values are cast to `dtype` (default float32): the request's dtype, which the reply
    keeps. Values out of that dtype's range become Inf (the service refuses them). With
    `shape`, the values (nested or flat, row-major) are reshaped to it. `check` gets the
    shape (declared, or the nested lists' outer lengths) before any value is converted.
    """
    if not isinstance(doc, dict) or name not in doc:
        if isinstance(doc, dict):
            found = f"an object with the keys {snip(sorted(doc)[:10])}" if doc else "an empty object"
        else:
            found = f"a JSON {type(doc).__name__}"
        raise InvalidTensorError(f'JSON body must be an object {{"{name}": [[...], ...]}}; found {found}')
    dtype = float_dtype(doc.get("dtype", "float32"), "JSON dtype")
    shape = None if doc.get("shape") is None else shape_of(doc["shape"], "JSON shape")
    return numbers_to_array(doc[name], dtype, what=name, shape=shape, check=check)


def mask_from_json(values: Any, what: str = MASK_NAME) -> np.ndarray:
    """A JSON attention mask (nested lists of 0/1 numbers or booleans) as an int64 array, the
    lists' rectangularity checked first; values other than 0/1 are the caller's to refuse."""
    nested = _nesting(values, what)
    if not nested or len(nested) > 2:
        raise InvalidTensorError(f"{what} must be a [batch, seq] (or [seq]) list of 0/1; nested as {list(nested)}")
    rows = _innermost_lists(values, nested, what)
    try:
        part = np.asarray(rows)
    except (ValueError, TypeError, OverflowError):
        raise InvalidTensorError(f"{what} must be a rectangular nested list of 0/1") from None
    if part.size and part.dtype.kind not in "biuf":
        raise InvalidTensorError(f"{what} must hold only 0/1 (or booleans); found non-numeric values")
    if part.dtype.kind == "f":
        if not np.isin(part, (0.0, 1.0)).all():
            raise InvalidTensorError(f"{what} must hold only 0 and 1; found other values")
    return part.astype(np.int64).reshape(nested)


def encode_json(array: np.ndarray, name: str = OUTPUT_NAME) -> bytes:
    """`{name: nested lists, "shape": [...], "dtype": dtype name}`, serialized by orjson from numpy
    (in chunks: see `json_values`). With name="hidden_states" it is a request body."""
    payload = {name: json_values(array), "shape": list(array.shape), "dtype": dtype_name(array.dtype)}
    return orjson.dumps(payload)


def json_values(array: np.ndarray) -> orjson.Fragment:
    """`array` as nested JSON lists, serialized in pieces of at most JSON_CHUNK_VALUES
    values (each one orjson call, so a serializing thread lets others run in between).
    bfloat16 is written through float32 (exact)."""
    array = array.astype(np.float32) if is_bfloat16(array.dtype) else np.require(array, requirements="C")
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
    values: Any, dtype: np.dtype, *, what: str, shape: Sequence[int] | None = None, check: ShapeCheck | None = None
) -> np.ndarray:
    """A (nested) JSON list of numbers as an array of `dtype` (reshaped to `shape` if given);
    strings, bools, nulls, ragged lists -> InvalidTensorError.

    Before any value is converted: the nesting's outer lengths give the array's shape,
    which must match `shape`'s element count and pass `check`. Then the innermost lists
    are converted by numpy (in C) a chunk at a time; only the dtype numpy infers for a
    chunk is inspected, so there is no per-element Python loop.
    """
    nested = _nesting(values, what)
    target = tuple(nested) if shape is None else tuple(shape)
    if check is not None:
        check(target)
    count = numel(nested)
    if shape is not None and count != numel(shape):
        found = f"{count} values" if len(nested) <= 1 else f"{count} values (nested as {list(nested)})"
        raise InvalidTensorError(f"{what} has {found}; shape {list(shape)} needs {numel(shape)}")
    if not nested:  # a bare number
        if type(values) not in (int, float):
            raise InvalidTensorError(f"{what} must hold only numbers; found {type(values).__name__}")
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
        raise InvalidTensorError(f"{what} must be a rectangular nested list of numbers") from None
    if part.shape != shape:
        raise InvalidTensorError(
            f"{what} must be a rectangular nested list of numbers (found lists inside the innermost lists)"
        )
    return _cast_numbers(part, dtype, what).reshape(-1)


def _cast_numbers(part: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    if part.dtype.kind not in "fiu":
        found = "non-numeric values" if part.dtype.kind in "OUSVb" else dtype_name(part.dtype)
        raise InvalidTensorError(f"{what} must hold only numbers; found {found} (numpy saw dtype {part.dtype.kind})")
    with np.errstate(over="ignore"):  # overflow -> Inf, refused by the service's validation
        return part.astype(dtype)


def _nesting(values: Any, what: str) -> tuple[int, ...]:
    """Lengths of the first list at each nesting level (O(depth); nothing is converted)."""
    lengths = []
    node = values
    while type(node) is list:
        lengths.append(len(node))
        if len(lengths) > MAX_DIMS:
            raise InvalidTensorError(f"{what} is nested more than {MAX_DIMS} lists deep")
        if not node:
            break
        node = node[0]
    check_dims(lengths, what)
    return tuple(lengths)


def _innermost_lists(values: list, nested: tuple[int, ...], what: str) -> list:
    """The innermost lists in row-major order, every level's length checked on the way
    (a Python loop over the lists only, never over the numbers)."""
    level = [values]
    for depth, length in enumerate(nested):
        for item in level:
            if type(item) is not list or len(item) != length:
                raise InvalidTensorError(
                    f"{what} must be a rectangular nested list of numbers "
                    f"(every list at depth {depth} should have {length} entries; nested as {list(nested)})"
                )
        if depth < len(nested) - 1:
            level = [inner for item in level for inner in item]
    return level


def _json_error_pos(exc: orjson.JSONDecodeError) -> int:
    return int(getattr(exc, "pos", -1) or 0)


# ---------------------------------------------------------------- shapes and bytes

def shape_of(shape: Any, what: str) -> tuple[int, ...]:
    """A declared shape: a list of at most MAX_DIMS non-negative ints (MalformedError if not even that)."""
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape[:MAX_DIMS + 1]):
        raise MalformedError(f"{what} must be at most {MAX_DIMS} non-negative integers; got {snip(shape)}")
    check_dims(shape, what)
    return tuple(shape)


def check_dims(shape: Sequence[int], what: str) -> None:
    """At most MAX_DIMS dims, each at most MAX_DIM, and a describable element count."""
    if len(shape) > MAX_DIMS:
        raise InvalidTensorError(f"{what} has {len(shape)} dimensions; at most {MAX_DIMS} are accepted")
    bound = 1
    for d in shape:
        bound *= max(int(d), 1)
    if any(d > MAX_DIM for d in shape) or bound > MAX_ELEMENTS_BOUND:
        raise InvalidTensorError(f"{what} {snip(list(shape))} is far too large")


def numel(shape: Sequence[int]) -> int:
    # Python ints: a lying header cannot overflow the product.
    total = 1
    for d in shape:
        total *= int(d)
    return total


def nbytes(shape: Sequence[int], dtype: np.dtype) -> int:
    return numel(shape) * dtype.itemsize


def little_endian(array: np.ndarray) -> np.ndarray:
    if array.dtype.byteorder == ">":
        return array.astype(array.dtype.newbyteorder("<"))
    return array
