"""Tensor wire formats on the service side: safetensors, npy, JSON and Open Inference Protocol v2 tensors.

The formats themselves (parsers, writers, dtype rules) are implemented once, in the client
distribution's `gangserve_client.codecs`, which the service depends on; the client encodes
requests and decodes replies with the same code. This module adds what only the service
does, and is what every route uses:

- `decode(body, media_type, limits) -> np.ndarray` returns the request tensor in its *wire*
  dtype: float16, bfloat16 (`ml_dtypes.bfloat16`), float32 or float64 (safetensors F16,
  BF16, F32, F64). Every other dtype is refused by name (422) while the header is read,
  before any data is touched. Binary formats are decoded zero-copy: the array is a
  read-only view of `body`.
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
- OIP v2 tensors (`decode_oip_tensor`, `oip_datatype`, `raw_bytes`, ...).

Every malformed input raises BadRequest (400), PayloadTooLarge (413) or InvalidInput
(422) with a message written by the codecs or here (never the text of an internal
exception, never more than a short excerpt of the input): the shared codecs raise
`WireFormatError`s, which the functions below re-raise as these service errors
(`_SERVICE_ERRORS`). Nothing ever unpickles; header parsing, caps and bounds checks are
described in `gangserve_client.codecs`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import ml_dtypes  # noqa: F401  (the service always carries bfloat16: the shared codecs need it installed)
import numpy as np

from gangserve_client import codecs as wire
from gangserve_client.codecs import (
    DTYPE_NAMES,
    FLOAT_DTYPES,
    INPUT_NAME,
    JSON,
    MASK_NAME,
    MEDIA_TYPES,
    NPY,
    OUTPUT_NAME,
    SAFETENSORS,
    dtype_name,
    snip,
)
from service.config.builder_args import AppConfig
from service.contract.errors import (
    BadRequest,
    GangServeError,
    InvalidInput,
    NotAcceptable,
    PayloadTooLarge,
    UnsupportedMediaType,
)

if wire.BFLOAT16 is None:  # pragma: no cover - ml_dtypes is imported above
    raise ImportError("gangserve_client.codecs found no ml_dtypes; the service needs bfloat16")
BFLOAT16: np.dtype = wire.BFLOAT16
MODEL_DTYPE = np.dtype(np.float32)
# JSON bombs: a valid body has a handful of objects, keys and strings. Bounds checked by a
# byte scan before parsing (strings that contain these bytes count too, harmlessly).
MAX_JSON_OBJECTS = 256
MAX_JSON_KEYS = 4096
MAX_JSON_STRINGS = 8192

# Open Inference Protocol v2 datatypes (only the floating ones are served).
OIP_TO_NP: dict[str, np.dtype] = {
    "FP16": np.dtype("<f2"), "BF16": BFLOAT16, "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
NP_TO_OIP = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32", "float64": "FP64"}

# The shared codecs' errors, as the service's HTTP errors (by class; the first match wins).
_SERVICE_ERRORS: tuple[tuple[type[wire.WireFormatError], type[GangServeError]], ...] = (
    (wire.InvalidTensorError, InvalidInput),
    (wire.UnencodableError, NotAcceptable),
    (wire.WireFormatError, BadRequest),  # MalformedError, and anything else the codecs call malformed
)
_F = TypeVar("_F", bound=Callable[..., Any])


def _service_errors(fn: _F) -> _F:
    """`fn`, raising the service error of any WireFormatError (same message, no chained internals)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except wire.WireFormatError as exc:
            service_error = next(cls for base, cls in _SERVICE_ERRORS if isinstance(exc, base))
            raise service_error(exc.message) from None
    return call  # type: ignore[return-value]


@dataclass(frozen=True)
class Limits:
    """What one request may declare; checked before any value is converted."""

    embed_dim: int
    max_seq_len: int
    max_tokens: int
    max_json_bytes: int | None = None

    @classmethod
    def of(cls, config: AppConfig) -> "Limits":
        """The app's limits: the model's width and the serving section's bounds."""
        serving = config.serving
        return cls(config.model.embed_dim, serving.max_seq_len, serving.max_tokens_per_request, serving.max_json_bytes)

    def check(self, shape: Sequence[int]) -> bool:
        """`check_shape` with these limits; True when the shape is [seq, E]."""
        return check_shape(shape, embed_dim=self.embed_dim, max_seq_len=self.max_seq_len, max_tokens=self.max_tokens)


def _check(limits: Limits | None) -> Callable[[tuple[int, ...]], object] | None:
    return limits.check if limits is not None else None


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

@_service_errors
def decode(body: bytes, media_type: str, limits: Limits | None = None) -> np.ndarray:
    """The request tensor `hidden_states` of `body` in its wire dtype (see the module docstring);
    binary formats as a zero-copy view of `body`, JSON parsed only after `loads_json`'s bounds."""
    if not body:
        raise BadRequest("request body is empty")
    if media_type == SAFETENSORS:
        return wire.decode_safetensors(body, INPUT_NAME, check=_check(limits))
    if media_type == NPY:
        return wire.decode_npy(body, check=_check(limits))
    if media_type == JSON:
        return wire.tensor_from_json(loads_json(body, limits), INPUT_NAME, check=_check(limits))
    raise UnsupportedMediaType(f"no decoder for {snip(media_type)}")


@_service_errors
def encode(array: np.ndarray, media_type: str) -> bytes:
    """`array` in `media_type`, keeping its dtype (tensor `output`; JSON adds shape and dtype)."""
    if media_type == SAFETENSORS:
        return wire.encode_safetensors({OUTPUT_NAME: array})
    if media_type == NPY:
        return wire.encode_npy(array)
    if media_type == JSON:
        return wire.encode_json(array)
    raise NotAcceptable(f"no encoder for {snip(media_type)}")


@_service_errors
def decode_request(body: bytes, media_type: str, limits: Limits | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """`decode`, plus the optional raw `attention_mask` next to hidden_states (JSON field,
    safetensors tensor; npy bodies carry one array, so never a mask). The mask is returned
    as sent: `validate_attention_mask` checks it against the hidden states."""
    if media_type == SAFETENSORS and body:
        return decode(body, media_type, limits), wire.decode_safetensors_mask(body)
    if media_type == JSON and body:
        doc = loads_json(body, limits)
        x = wire.tensor_from_json(doc, INPUT_NAME, check=_check(limits))
        raw = doc.get(MASK_NAME)
        return x, None if raw is None else wire.mask_from_json(raw)
    return decode(body, media_type, limits), None


MASK_DTYPES = ("bool", "uint8", "int32", "int64")


def validate_attention_mask(mask: np.ndarray | None, x_shape: Sequence[int], squeezed: bool) -> np.ndarray | None:
    """The request's key padding mask as [batch, seq] bool (True = token), or None when there
    is none or it marks every position a token (then the unmasked fast path computes the
    same function). `x_shape` is the validated [batch, seq, E]; `squeezed` says the request
    was [seq, E], whose mask is [seq]. Refuses (422) another shape, a dtype other than
    bool/uint8/int32/int64, values other than 0/1, and a sequence with no token at all.
    """
    if mask is None:
        return None
    batch, seq = int(x_shape[0]), int(x_shape[1])
    want = (seq,) if squeezed else (batch, seq)
    if dtype_name(mask.dtype) not in MASK_DTYPES:
        raise InvalidInput(f"{MASK_NAME} must be {', '.join(MASK_DTYPES)} (0/1 values); got dtype {dtype_name(mask.dtype)}")
    if tuple(mask.shape) != want:
        what = "[seq]" if squeezed else "[batch, seq]"
        raise InvalidInput(
            f"{MASK_NAME} must be {what} = {list(want)} to match {INPUT_NAME} {list(x_shape if not squeezed else x_shape[1:])}; "
            f"got shape {snip(list(mask.shape))}"
        )
    mask = mask.reshape(batch, seq)
    if mask.dtype != np.bool_:
        if not ((mask == 0) | (mask == 1)).all():
            bad = mask[(mask != 0) & (mask != 1)].reshape(-1)[:3].tolist()
            raise InvalidInput(f"{MASK_NAME} must hold only 0 (padding) and 1 (token); found {snip(bad)}")
        mask = mask.astype(bool)
    tokens = mask.any(axis=1)
    if not tokens.all():
        rows = np.flatnonzero(~tokens)[:5].tolist()
        raise InvalidInput(
            f"{MASK_NAME} marks every position of sequence(s) {rows} as padding; each sequence needs at least one token"
        )
    if mask.all():
        return None
    return np.ascontiguousarray(mask)


# ---------------------------------------------------------------- JSON bounds

def loads_json(body: bytes | memoryview, limits: Limits | None = None, *, what: str = "JSON body") -> Any:
    """Parse a JSON body after bounding it: max_json_bytes (413), then `prescan_json` (422)."""
    if limits is not None:
        if limits.max_json_bytes is not None and len(body) > limits.max_json_bytes:
            raise PayloadTooLarge(f"{what} is {len(body)} bytes; the limit is max_json_bytes={limits.max_json_bytes}")
        prescan_json(body, limits.embed_dim, what=what)
    try:
        return wire.loads_json(body, what=what)
    except wire.MalformedError as exc:
        raise BadRequest(exc.message) from None


def prescan_json(body: bytes | memoryview, embed_dim: int, *, what: str = "JSON body") -> None:
    """Refuse, by counting bytes (C speed, before parsing), JSON that cannot be a tensor request
    but would cost far more to parse and convert than its size suggests: millions of empty
    lists, objects, keys or strings.

    A tensor of width E nested as lists has at most 2 lists per E numbers (one per row,
    one per batch entry, plus the outer one), and an attention mask next to it at most one
    more (one per batch entry); its numbers are separated by commas, so
    `lists <= 3 * (commas + 1) / (E - 1) + slack` holds for every valid body.
    """
    data = body if isinstance(body, bytes) else bytes(body)
    lists, commas = data.count(b"["), data.count(b",")
    allowed_lists = 3 * (commas + 1) // max(embed_dim - 1, 1) + 16
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


# ---------------------------------------------------------------- OIP v2 tensors

@_service_errors
def decode_oip_tensor(
    datatype: str, shape: Sequence[int], *, data: Any = None, raw: memoryview | bytes | None = None, name: str,
    limits: Limits | None = None,
) -> np.ndarray:
    """One OIP v2 input tensor, from JSON `data` (flat or nested, row-major) or binary `raw` bytes."""
    dtype = OIP_TO_NP.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise InvalidInput(f"input {snip(name)} datatype must be one of {', '.join(OIP_TO_NP)}; got {snip(datatype)}")
    shape = wire.shape_of(list(shape), f"shape of input {snip(name)}")
    if limits is not None:
        limits.check(shape)
    if raw is not None:
        return _oip_binary(raw, dtype, shape, datatype, name)
    if data is None:
        raise BadRequest(f"input {snip(name)} has neither JSON 'data' nor a binary_data_size parameter")
    return wire.numbers_to_array(data, dtype, what=f"data of input {snip(name)}", shape=shape)


def _oip_binary(raw: memoryview | bytes, dtype: np.dtype, shape: Sequence[int], datatype: str, name: str) -> np.ndarray:
    """An input's binary tensor data (Triton's binary extension): exactly numel x itemsize bytes."""
    needed = wire.numel(shape) * dtype.itemsize
    if len(raw) != needed:
        raise BadRequest(f"input {snip(name)} has binary_data_size {len(raw)}; shape {list(shape)} {datatype} needs {needed}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


OIP_MASK_TO_NP: dict[str, np.dtype] = {
    "BOOL": np.dtype(bool), "UINT8": np.dtype("u1"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
}


@_service_errors
def decode_oip_mask(
    datatype: str, shape: Sequence[int], *, data: Any = None, raw: memoryview | bytes | None = None, name: str,
) -> np.ndarray:
    """The optional OIP input `attention_mask` (BOOL, UINT8, INT32 or INT64) from JSON `data`
    (flat or nested) or binary `raw` bytes; values and shape are checked by
    `validate_attention_mask`."""
    dtype = OIP_MASK_TO_NP.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise InvalidInput(f"input {snip(name)} datatype must be one of {', '.join(OIP_MASK_TO_NP)}; got {snip(datatype)}")
    shape = wire.shape_of(list(shape), f"shape of input {snip(name)}")
    count = wire.numel(shape)
    if raw is not None:
        return _oip_binary(raw, dtype, shape, datatype, name)
    if data is None:
        raise BadRequest(f"input {snip(name)} has neither JSON 'data' nor a binary_data_size parameter")
    values = wire.mask_from_json(data, what=f"data of input {snip(name)}")
    if values.size != count:
        raise InvalidInput(f"data of input {snip(name)} has {values.size} values; shape {list(shape)} needs {count}")
    return values.reshape(shape)


def oip_datatype(dtype: np.dtype) -> str:
    """OIP datatype name of a float dtype ('FP32', 'BF16', ...)."""
    return NP_TO_OIP[dtype_name(dtype)]


def raw_bytes(array: np.ndarray) -> memoryview:
    """Little-endian row-major bytes of `array` (no copy when already contiguous)."""
    return wire.little_endian(np.require(array, requirements="C")).reshape(-1).view(np.uint8).data


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
        raise InvalidInput(f"{wire.ACCEPTED}; got dtype {dtype_name(dtype)}")
