"""Hostile input and auth (issue 12, items 1-3).

Property-based fuzzing of every decoder (npy headers, safetensors headers, JSON bodies,
OIP JSON and binary requests, mutations of valid bodies), first in-process (no Ray, a few
hundred examples each, called directly), then through the running service over HTTP
(fewer examples): never a 5xx, never an untyped exception, errors bounded and free of
internal exception text, each answer within a bounded time, and the service computes
right afterwards. Then the bounded decoding pool, JSON bombs next to valid traffic, the
ASGI-level auth (before any body is read), the optional inference token, /gang without
paths, and the state dir's mode.

Every hypothesis test is deterministic (derandomize=True, database=None, deadline=None).
"""
from __future__ import annotations

import asyncio
import gzip
import io
import json
import logging
import os
import re
import socket
import stat
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import torch
from gangserve_client import codecs as wire
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save as st_save

from service.ingress import codecs
from service.ingress.auth import load_api_token, redact_paths, required_token
from service.contract.errors import MAX_MESSAGE_CHARS, GangServeError, Overloaded
from service.ingress.deps import DecodePool
from service.ingress.oip import codec as oip_codec
from service.ingress.oip import routes as oip
from service.ingress.oip.schemas import HEADER_LENGTH as OIP_HEADER_LENGTH
from service.state.paths import state_dir
from tests.conftest import TEST_API_TOKEN, local_yaml_args, suite_args, undeploy, wait_ready
from tests.helpers import eventually, eventually_async, one_decode_slot_held
from tests.reference import reference, relative_error

AUTH = {"authorization": f"Bearer {TEST_API_TOKEN}"}
INFER_TOKEN = "infer-token-9876543210"


def deterministic(max_examples: int) -> settings:
    return settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


# Small limits keep in-process examples cheap; the checks are the same code as in the service.
E = 8
LIMITS = codecs.Limits(embed_dim=E, max_seq_len=16, max_tokens=64, max_json_bytes=64 * 1024)
SERVICE_LIMITS = codecs.Limits(embed_dim=512, max_seq_len=4096, max_tokens=262144, max_json_bytes=8 * 1024 * 1024)
TYPED_STATUSES = {400, 413, 415, 422}
# Text that only an internal exception would put in a message.
INTERNAL_TEXT = re.compile(r"Traceback|Error\b|Exception|line \d+ column|Errno|object at 0x|File \"")
TIME_BOUND_S = 5.0  # per decode, on a loaded 2-core machine (typical: well under 50 ms)


def check_error(exc: GangServeError) -> None:
    assert exc.status in TYPED_STATUSES, (exc.status, exc.message)
    assert exc.message and len(exc.message) <= MAX_MESSAGE_CHARS
    assert not INTERNAL_TEXT.search(exc.message), exc.message


def decoded_or_typed_error(fn: Callable[[], np.ndarray], limits: codecs.Limits | None = LIMITS) -> np.ndarray | None:
    """fn()'s array (then validated like the route does), or None after a typed 4xx."""
    start = time.perf_counter()
    try:
        array = fn()
        assert wire.dtype_name(array.dtype) in wire.FLOAT_DTYPES, array.dtype
        if limits is not None:
            codecs.validate_hidden_states(array, embed_dim=limits.embed_dim, max_seq_len=limits.max_seq_len,
                                          max_tokens=limits.max_tokens)
        return array
    except GangServeError as exc:
        check_error(exc)
        return None
    finally:
        assert time.perf_counter() - start < TIME_BOUND_S


# ---------------------------------------------------------------- strategies

def npy_file(header: str, version: tuple[int, int] = (1, 0), data: bytes = b"", header_len: int | None = None) -> bytes:
    text = header.encode("utf-8" if version[0] == 3 else "latin-1", errors="replace")
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    length = len(text) if header_len is None else header_len
    prefix = struct.pack("<H", length & 0xFFFF) if version[0] == 1 else struct.pack("<I", length & 0xFFFFFFFF)
    return wire.NPY_MAGIC + bytes(version) + prefix + text + data


NPY_DESCRS = ["<f4", "<f2", "<f8", ">f4", ">f8", "=f4", "<f16", "<g", "<c8", "<c16", "<i8", "<u4", "|b1", "|V2",
              "|V4", "|O", "<U4", "|S3", "<M8[s]", "<m8", "float32", "f4,i4", " <f4", "<f4 ", "<f0", "<f99999999"]
_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=6))
json_trees = st.recursive(_json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=30)
_dims = st.one_of(st.integers(0, 4), st.integers(-3, 2**70), st.booleans(), st.floats(), st.none(), st.text(max_size=2))
declared_shapes = st.one_of(st.lists(st.integers(1, 3), min_size=1, max_size=3).map(lambda s: [*s[:-1], E]),
                            st.lists(_dims, max_size=10), json_trees)


def rarely(draw: st.DrawFn, percent: int = 20) -> bool:
    """True in about `percent`% of examples: mostly-valid inputs reach the deeper checks."""
    return draw(st.sampled_from([False] * (100 - percent) + [True] * percent))


@st.composite
def npy_bodies(draw: st.DrawFn) -> bytes:
    descr: Any = draw(st.sampled_from(["<f4", "<f2", "<f8", ">f4"]))
    if rarely(draw, 40):
        descr = draw(st.one_of(st.sampled_from(NPY_DESCRS), st.text(max_size=8),
                               st.lists(st.tuples(st.text(max_size=3), st.sampled_from(["<f4", "<i4"])), max_size=3),
                               st.just(("<f4", (2,)))))
    shape: Any = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2).map(lambda s: (*s, E)))
    if rarely(draw, 40):
        shape = draw(st.one_of(st.lists(st.integers(0, 3), max_size=3).map(lambda s: (*s, E)),
                               st.lists(_dims, max_size=70).map(tuple), st.lists(st.integers(0, 3), max_size=3),
                               _json_scalar))
    fortran = draw(st.booleans()) if not rarely(draw, 10) else draw(st.sampled_from([0, 1, None, "False"]))
    keys = {"descr": descr, "fortran_order": fortran, "shape": shape}
    if rarely(draw, 10):
        keys = {k: v for k, v in keys.items() if draw(st.booleans())} | draw(st.dictionaries(st.text(max_size=4), _json_scalar, max_size=2))
    header = repr(keys)
    if rarely(draw, 10):
        header = draw(st.one_of(st.text(max_size=200),
                                st.integers(1, 400).map(lambda n: "{'shape': " + "(" * n + ")" * n + "}")))
    version = (1, 0) if not rarely(draw) else draw(st.sampled_from([(2, 0), (3, 0), (0, 0), (4, 0), (1, 1)]))
    try:
        needed = int(np.prod(shape)) * np.dtype(descr).itemsize if isinstance(shape, tuple) and len(shape) < 6 else 0
    except Exception:
        needed = 0
    needed = min(max(needed, 0), 4096)
    data = b"\0" * needed
    if rarely(draw):
        data = draw(st.one_of(st.just(data[:-1]), st.binary(max_size=128), st.just(data + b"\0")))
    header_len = None if not rarely(draw, 10) else draw(st.integers(0, 70000))
    return npy_file(header, version, data, header_len)


@st.composite
def safetensors_bodies(draw: st.DrawFn) -> bytes:
    shape: Any = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2).map(lambda s: [*s, E]))
    if rarely(draw, 30):
        shape = draw(st.one_of(st.lists(_dims, max_size=10), st.just([0, 2**40]), st.just([0] + [2**31 - 1] * 3),
                               st.lists(st.integers(0, 3), max_size=3)))
    dtype: Any = draw(st.sampled_from(["F32", "F16", "BF16", "F64"]))
    if rarely(draw, 30):
        dtype = draw(st.one_of(st.sampled_from(["I64", "U8", "BOOL", "F8_E4M3", "C64", "f32"]), _json_scalar,
                               st.lists(st.text(max_size=2), max_size=2)))
    try:
        count = int(np.prod([int(d) for d in shape])) if all(type(d) is int and 0 <= d < 64 for d in shape) else 3
    except Exception:
        count = 3
    itemsize = {"F16": 2, "BF16": 2, "F64": 8, "U8": 1, "BOOL": 1}.get(dtype if isinstance(dtype, str) else "", 4)
    nbytes = min(count * itemsize, 4096)
    offsets: Any = [0, nbytes]
    if rarely(draw):
        offsets = draw(st.one_of(st.lists(st.one_of(st.integers(-5, 2**65), st.floats()), max_size=3), _json_scalar,
                                 st.just([1, nbytes + 1]), st.just([0, nbytes - 1])))
    entry: Any = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    if rarely(draw, 10):
        entry = draw(json_trees)
    name = "hidden_states" if not rarely(draw, 10) else draw(st.sampled_from(["x", "", "output"]))
    header: Any = {name: entry}
    if rarely(draw):
        header["__metadata__"] = draw(json_trees)
    if rarely(draw, 5):
        header = draw(json_trees)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8) if not rarely(draw, 50) else b""
    length = len(text) if not rarely(draw, 10) else draw(st.integers(0, 2**64 - 1))
    buffer = b"\0" * nbytes if not rarely(draw) else draw(st.binary(max_size=64))
    return struct.pack("<Q", length) + text + buffer


def nested_numbers(shape: list[int], fill: Any = 0.5) -> Any:
    return [nested_numbers(shape[1:], fill) for _ in range(shape[0])] if shape else fill


@st.composite
def json_bodies(draw: st.DrawFn) -> bytes:
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2).map(lambda s: [*s, E]))
    if rarely(draw):
        shape = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
    fill = draw(st.one_of(st.floats(width=32, allow_nan=False, allow_infinity=False), st.integers(-10, 10)))
    if rarely(draw):
        fill = draw(st.one_of(st.floats(), _json_scalar))
    values: Any = nested_numbers(shape, fill)
    if rarely(draw):
        values = draw(st.one_of(json_trees, st.lists(st.one_of(st.floats(), st.integers()), max_size=40)))
    doc: Any = {"hidden_states": values}
    if draw(st.booleans()):
        doc["dtype"] = draw(st.sampled_from(wire.DTYPE_NAMES))
        if rarely(draw):
            doc["dtype"] = draw(st.one_of(st.sampled_from(["int8", "float128", "complex64", "bool"]), json_trees))
    if draw(st.booleans()):
        doc["shape"] = shape if not rarely(draw, 40) else draw(declared_shapes)
        if not rarely(draw, 30):
            doc["hidden_states"] = np.asarray(values, dtype=object).reshape(-1).tolist() if not rarely(draw) and \
                isinstance(values, list) and doc["shape"] == shape else values
    if rarely(draw, 5):
        doc = draw(json_trees)
    return json.dumps(doc).encode()


@st.composite
def oip_requests(draw: st.DrawFn) -> tuple[bytes, str, int | None, str | None]:
    """(body, content encoding, Inference-Header-Content-Length, output_dtype)."""
    shape: Any = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2).map(lambda s: [*s, E]))
    if rarely(draw):
        shape = draw(declared_shapes)
    datatype: Any = draw(st.sampled_from(["FP32", "FP16", "BF16", "FP64"]))
    if rarely(draw):
        datatype = draw(st.one_of(st.sampled_from(["INT32", "BYTES", "FP8", "fp32"]), _json_scalar))
    name = "hidden_states" if not rarely(draw, 10) else draw(st.sampled_from(["x", "", "output"]))
    tensor: Any = {"name": name, "shape": shape, "datatype": datatype}
    binary = draw(st.booleans())
    small = isinstance(shape, list) and all(type(d) is int and 0 <= d < 64 for d in shape)
    count = int(np.prod(shape)) if small else 4
    itemsize = {"FP16": 2, "BF16": 2, "FP64": 8}.get(datatype if isinstance(datatype, str) else "", 4)
    raw = b""
    if binary:
        raw = b"\0" * min(count * itemsize, 4096) if not rarely(draw) else draw(st.binary(max_size=64))
        size: Any = len(raw) if not rarely(draw) else draw(_json_scalar)
        tensor["parameters"] = {"binary_data_size": size}
    else:
        nested = small and all(d < 5 for d in shape) and draw(st.booleans())
        tensor["data"] = nested_numbers(shape, 1.0) if nested else [0.25] * min(count, 4096)
        if rarely(draw):
            tensor["data"] = draw(json_trees)
    if rarely(draw, 5):
        tensor = draw(st.dictionaries(st.sampled_from(["name", "shape", "datatype", "parameters", "data", "x"]),
                                      json_trees, max_size=5))
    doc: Any = {"inputs": [tensor] * (1 if not rarely(draw, 10) else draw(st.sampled_from([0, 2, 20])))}
    if draw(st.booleans()):
        flag: Any = draw(st.booleans()) if not rarely(draw) else draw(_json_scalar)
        doc["outputs"] = [{"name": "output", "parameters": {"binary_data": flag}}]
        if rarely(draw):
            doc["outputs"] = draw(json_trees)
    if rarely(draw):
        doc["parameters"] = draw(st.one_of(st.just({"binary_data_output": True}), json_trees))
    if rarely(draw):
        doc["id"] = draw(st.one_of(st.text(max_size=8), json_trees))
    if rarely(draw, 5):
        doc = draw(json_trees)
    header = json.dumps(doc).encode()
    body = header + raw
    header_length = len(header) if binary else None
    if rarely(draw, 10):
        header_length = draw(st.integers(0, len(body) + 10))
    encoding = "identity" if not rarely(draw, 30) else draw(st.sampled_from(["gzip", "deflate"]))
    if encoding == "gzip":
        body = gzip.compress(body)
    elif encoding == "deflate":
        body = zlib.compress(body)
    if rarely(draw, 10):
        body = body[: draw(st.integers(0, len(body)))]
    output_dtype = None if not rarely(draw, 30) else draw(st.sampled_from(["float16", "bfloat16", "float64"]))
    return body, encoding, header_length, output_dtype


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """`valid` with a few byte-level edits: flips, deletions, insertions, truncation, duplication."""
    body = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "delete", "insert", "truncate", "duplicate", "set"]))
        pos = draw(st.integers(0, max(len(body) - 1, 0)))
        if op == "flip" and body:
            body[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and body:
            body[pos] = draw(st.sampled_from(b'[]{},:"0-.eE\x00\xff9'))
        elif op == "delete":
            del body[pos:pos + draw(st.integers(1, 16))]
        elif op == "insert":
            body[pos:pos] = draw(st.one_of(st.binary(min_size=1, max_size=16), st.sampled_from([b"[", b"]]]", b",1e999", b'"x"', b"{}"])))
        elif op == "truncate":
            del body[pos:]
        elif op == "duplicate":
            body[pos:pos] = body[pos:pos + draw(st.integers(1, 64))]
    return bytes(body)


def valid_bodies(x: np.ndarray) -> dict[str, bytes]:
    npy = io.BytesIO()
    np.save(npy, x, allow_pickle=False)
    return {
        wire.NPY: npy.getvalue(),
        wire.SAFETENSORS: st_save({"hidden_states": x}),
        wire.JSON: json.dumps({"hidden_states": x.tolist()}).encode(),
    }


def oip_body(x: np.ndarray, binary: bool) -> tuple[bytes, int | None]:
    tensor: dict[str, Any] = {"name": "hidden_states", "shape": list(x.shape), "datatype": "FP32"}
    if binary:
        tensor["parameters"] = {"binary_data_size": x.nbytes}
        header = json.dumps({"inputs": [tensor], "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
        return header + x.tobytes(), len(header)
    tensor["data"] = x.ravel().tolist()
    return json.dumps({"inputs": [tensor]}).encode(), None


def prepare_oip(body: bytes, encoding: str, header_length: int | None, output_dtype: str | None,
                limits: codecs.Limits = LIMITS) -> None:
    """The OIP route's whole decoding step (inflate, parse, check, decode), called directly."""
    assert limits.max_json_bytes is not None
    cap = (limits.max_json_bytes, "max_json_bytes") if header_length is None else (1 << 20, "max_body_bytes")
    start = time.perf_counter()
    try:
        _, x, _, _, dtype, _ = oip_codec.prepare(body, encoding, cap, header_length, limits, output_dtype)
        assert x.dtype == np.float32 and x.ndim == 3 and x.shape[-1] == limits.embed_dim
        assert wire.dtype_name(dtype) in wire.FLOAT_DTYPES
    except GangServeError as exc:
        check_error(exc)
    finally:
        assert time.perf_counter() - start < TIME_BOUND_S


# ---------------------------------------------------------------- in-process fuzzing (no Ray)

@deterministic(400)
@given(npy_bodies())
@pytest.mark.unit
def test_fuzz_npy_headers(body: bytes) -> None:
    decoded_or_typed_error(lambda: codecs.decode(body, wire.NPY, LIMITS))
    decoded_or_typed_error(lambda: codecs.decode(body, wire.NPY), limits=None)  # without limits too (the client uses it)


@deterministic(400)
@given(safetensors_bodies())
@pytest.mark.unit
def test_fuzz_safetensors_headers(body: bytes) -> None:
    array = decoded_or_typed_error(lambda: codecs.decode(body, wire.SAFETENSORS, LIMITS))
    if array is not None:  # whatever was accepted lies exactly inside the body
        assert array.nbytes <= len(body)
    decoded_or_typed_error(lambda: codecs.decode(body, wire.SAFETENSORS), limits=None)


@deterministic(400)
@given(json_bodies())
@pytest.mark.unit
def test_fuzz_json_bodies(body: bytes) -> None:
    decoded_or_typed_error(lambda: codecs.decode(body, wire.JSON, LIMITS))
    decoded_or_typed_error(lambda: codecs.decode(body, wire.JSON), limits=None)


@deterministic(400)
@given(oip_requests())
@pytest.mark.unit
def test_fuzz_oip_requests(request: tuple[bytes, str, int | None, str | None]) -> None:
    prepare_oip(*request)


_X = np.random.default_rng(0).standard_normal((2, 3, E)).astype(np.float32)
_VALID = {**valid_bodies(_X), "oip-json": oip_body(_X, False)[0], "oip-binary": oip_body(_X, True)[0]}


@deterministic(500)
@given(st.sampled_from(sorted(_VALID)).flatmap(lambda kind: st.tuples(st.just(kind), mutated(_VALID[kind]))))
@pytest.mark.unit
def test_fuzz_mutated_valid_bodies(case: tuple[str, bytes]) -> None:
    kind, body = case
    if kind == "oip-json":
        prepare_oip(body, "identity", None, None)
    elif kind == "oip-binary":
        prepare_oip(body, "identity", oip_body(_X, True)[1], None)
    else:
        decoded_or_typed_error(lambda: codecs.decode(body, kind, LIMITS))


@pytest.mark.unit
def test_valid_bodies_still_decode_exactly() -> None:
    for media, body in valid_bodies(_X).items():
        assert np.array_equal(codecs.decode(body, media, LIMITS), _X), media
    for binary in (False, True):
        body, header_length = oip_body(_X, binary)
        _, x, _, squeezed, dtype, _ = oip_codec.prepare(body, "identity", (1 << 20, "max_body_bytes"), header_length, LIMITS, None)
        assert np.array_equal(x, _X) and not squeezed and dtype == np.float32
    gz, _ = oip_body(_X, False)
    _, x, _, _, _, _ = oip_codec.prepare(gzip.compress(gz), "gzip", (LIMITS.max_json_bytes, "max_json_bytes"), None, LIMITS, None)
    assert np.array_equal(x, _X)


@pytest.mark.parametrize("descr, name", [
    ("<f16", "float128"), ("<c8", "complex64"), ("<i8", "int64"), ("|b1", "bool"), ("|V2", "bfloat16"), ("<U4", "str"),
])
@pytest.mark.unit
def test_npy_dtypes_outside_the_four_are_refused_by_name(descr: str, name: str) -> None:
    body = npy_file(f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': (1, {E}), }}",
                    data=b"\0" * (E * np.dtype(descr).itemsize))
    with pytest.raises(GangServeError) as info:
        codecs.decode(body, wire.NPY, LIMITS)
    assert info.value.status == 422 and name in info.value.message and "floating-point" in info.value.message


@pytest.mark.parametrize("header", [
    "{'descr': '<f4', 'fortran_order': False, 'shape': (True, 8)}",  # a bool dim
    "{'descr': '<f4', 'fortran_order': False, 'shape': (%s)}" % ("1, " * 70),  # > 64 dims
    "{'descr': [('a', '<f4', (2,))], 'fortran_order': False, 'shape': (1,)}",  # structured / subarray
    "{'descr': ('<f4', (2,)), 'fortran_order': False, 'shape': (1,)}",  # subarray
    "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 2**70)}",  # not a literal: BinOp
    "{'descr': '<f4', 'fortran_order': False, 'shape': (0, %d)}" % 2**62,  # zero-size, huge dim
    "{'descr': '<f4', 'fortran_order': False, 'shape': " + "(" * 300 + ")" * 300 + "}",  # parser stack
    "{'descr': '<f4', 'fortran_order': 'no', 'shape': (1, 8)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 8), 'extra': 1}",
])
@pytest.mark.unit
def test_npy_header_crafts_that_gave_500s(header: str) -> None:
    with pytest.raises(GangServeError) as info:
        codecs.decode(npy_file(header), wire.NPY, LIMITS)
    check_error(info.value)


@pytest.mark.parametrize("body", [
    b'{"hidden_states": [[1.0]], "dtype": {}}',
    b'{"hidden_states": [[1.0]], "dtype": []}',
    b'{"hidden_states": [[1.0]], "dtype": "float128"}',
    b'{"hidden_states": [[1.0]], "dtype": "complex64"}',
    b'{"hidden_states": [], "shape": [0, 1000000000000000000000]}',
    b'{"hidden_states": [], "shape": {"a": 1}}',
])
@pytest.mark.unit
def test_json_crafts_that_gave_500s(body: bytes) -> None:
    with pytest.raises(GangServeError) as info:
        codecs.decode(body, wire.JSON, LIMITS)
    check_error(info.value)


@pytest.mark.unit
def test_safetensors_zero_size_tensor_with_a_huge_dim_is_refused() -> None:
    for shape in ([0, 2**40], [0, 2**62], [0] + [2**31 - 1] * 3):
        header = json.dumps({"hidden_states": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
        with pytest.raises(GangServeError) as info:
            codecs.decode(struct.pack("<Q", len(header)) + header, wire.SAFETENSORS)
        check_error(info.value)


def bomb(kind: str, size: int) -> bytes:
    """About `size` bytes of JSON that is cheap to send and expensive to parse or convert."""
    unit = {"empty lists": b"[],", "objects": b"{},", "keys": b'"a":1,', "strings": b'"a",', "zeros": b"0,",
            "nested rows": b"[0],"}[kind]
    items = unit * (size // len(unit))
    if kind == "keys":
        return b'{"hidden_states": [[1]], ' + items.rstrip(b",") + b"}"
    return b'{"hidden_states": [' + items.rstrip(b",") + b"]}"


@pytest.mark.parametrize("kind", ["empty lists", "objects", "keys", "strings", "zeros", "nested rows"])
@pytest.mark.unit
def test_json_bombs_are_refused_before_they_are_converted(kind: str) -> None:
    body = bomb(kind, SERVICE_LIMITS.max_json_bytes - 64)
    start = time.perf_counter()
    with pytest.raises(GangServeError) as info:
        codecs.decode(body, wire.JSON, SERVICE_LIMITS)
    elapsed = time.perf_counter() - start
    check_error(info.value)
    assert info.value.status == 422 and elapsed < TIME_BOUND_S, (elapsed, info.value.message)
    with pytest.raises(GangServeError) as info:  # one byte over the limit: 413, not parsed at all
        codecs.decode(bomb(kind, SERVICE_LIMITS.max_json_bytes + 64), wire.JSON, SERVICE_LIMITS)
    assert info.value.status == 413 and "max_json_bytes" in info.value.message


@pytest.mark.unit
def test_gzip_bomb_inflates_only_up_to_the_json_cap() -> None:
    inflated = bomb("empty lists", 64 * 1024 * 1024)
    body = gzip.compress(inflated, 9)
    assert len(body) < 200 * 1024
    start = time.perf_counter()
    with pytest.raises(GangServeError) as info:
        oip_codec.prepare(body, "gzip", (SERVICE_LIMITS.max_json_bytes, "max_json_bytes"), None, SERVICE_LIMITS, None)
    assert info.value.status == 413 and "max_json_bytes" in info.value.message
    assert time.perf_counter() - start < TIME_BOUND_S


@pytest.mark.unit
def test_error_messages_are_bounded() -> None:
    assert len(GangServeError("x" * 100_000).message) == MAX_MESSAGE_CHARS
    huge = json.dumps({"hidden_states": [["a" * 50_000]]}).encode()
    with pytest.raises(GangServeError) as info:
        codecs.decode(huge, wire.JSON)
    assert len(info.value.message) < 300


# ---------------------------------------------------------------- the decoding pool

@pytest.mark.unit
def test_decode_pool_admission_is_bounded_by_work_really_running() -> None:
    async def main() -> None:
        pool = DecodePool(threads=1, max_pending=2)
        release = threading.Event()
        first = asyncio.ensure_future(pool.run(release.wait, 30))
        second = asyncio.ensure_future(pool.run(release.wait, 30))
        await eventually_async(lambda: pool.pending == 2, 5, "both submissions admitted")
        with pytest.raises(Overloaded) as info:
            await pool.run(sum, [1, 2])
        assert info.value.status == 503 and info.value.code == "overloaded" and info.value.retry_after_s
        first.cancel()  # a disconnected client: its work still occupies the thread ...
        await eventually_async(first.done, 5, "the first submission's waiter cancelled")
        with pytest.raises(Overloaded):  # ... so its slot is not free yet
            await pool.run(sum, [1, 2])
        release.set()
        assert await second is True
        await eventually_async(lambda: pool.pending == 0, 5, "every slot free once the work ended")
        assert await pool.run(sum, [1, 2]) == 3 and pool.refused == 2
        pool.shutdown()

    asyncio.run(main())


class _DenseGang:
    """Stands in for the gang behind the ingress: the independent dense reference answers."""

    async def infer(self, x: np.ndarray, mask: Any, causal: Any, deadline: float) -> np.ndarray:
        return reference(x).numpy()


@pytest.mark.unit
def test_a_full_decoding_pool_answers_503_overloaded_and_serves_once_a_slot_is_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_threads=1, max_pending_decodes=1, the one slot held: a large JSON body (decoded
    in the pool) is answered 503 `overloaded` + Retry-After at once; freed, the same body is
    decoded and answered right. The ingress's real app, in-process."""
    from starlette.testclient import TestClient

    from service.app import parse_args
    from service.ingress.api import create_api

    monkeypatch.delenv("GANGSERVE_INFER_TOKEN", raising=False)
    cfg = parse_args({**local_yaml_args(), "decode_threads": 1, "max_pending_decodes": 1, "max_json_bytes": 1 << 20})
    app = create_api(cfg, gang=_DenseGang())  # type: ignore[arg-type]
    x = np.round(np.random.default_rng(5).standard_normal((1, 160, 512)), 3)  # ~0.7 MiB of JSON
    body = json.dumps({"hidden_states": x.tolist()}).encode()
    assert 64 * 1024 < len(body) < 1 << 20  # over the inline size: decoded in the pool
    pool: DecodePool = app.state.decode_pool
    try:
        with one_decode_slot_held(pool) as free, TestClient(app, base_url="http://127.0.0.1") as client:
            r = client.post("/infer", content=body, headers={"content-type": wire.JSON})
            assert r.status_code == 503 and r.json()["code"] == "overloaded", r.text
            assert int(r.headers["retry-after"]) >= 1 and "max_pending_decodes=1" in r.json()["error"]
            free()
            r = client.post("/infer", content=body, headers={"content-type": wire.JSON})
            assert r.status_code == 200, r.text
            assert relative_error(torch.tensor(r.json()["output"]), reference(x)) < 1e-5
        assert pool.refused == 1
    finally:
        pool.shutdown()


# ---------------------------------------------------------------- state dir, token file, redaction

@pytest.mark.unit
def test_state_dir_is_created_private_and_an_exposed_one_is_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("GANGSERVE_STATE_DIR", str(tmp_path / "fresh" / "state"))
    created = state_dir()
    assert stat.S_IMODE(created.stat().st_mode) == 0o700
    exposed = tmp_path / "exposed"
    exposed.mkdir()
    exposed.chmod(0o755)
    monkeypatch.setenv("GANGSERVE_STATE_DIR", str(exposed))
    with caplog.at_level(logging.WARNING, logger="gangserve.state"):
        assert state_dir() == exposed.resolve()
    assert any("group/others can read" in r.getMessage() and "755" in r.getMessage() for r in caplog.records)
    monkeypatch.delenv("GANGSERVE_API_TOKEN", raising=False)
    token_file = exposed / "api_token"
    token_file.write_text("t0ken\n")
    token_file.chmod(0o644)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gangserve.auth"):
        assert load_api_token(exposed) == ("t0ken", str(token_file))
    assert any("chmod 600" in r.getMessage() for r in caplog.records)


@pytest.mark.unit
def test_paths_and_protected_routes() -> None:
    info = {"weights_source": "checkpoint:/srv/state/weights/ab12.safetensors", "reason": "cannot read ~/w.st: gone",
            "ranks": [{"node_ip": "10.0.0.1", "iface": "eth0"}], "n": 3, "url": "http://host:8000/x"}
    assert redact_paths(info) == {**info, "weights_source": "checkpoint:<path>", "reason": "cannot read <path>: gone"}
    for path in ("/train", "/train/", "/train/job-1/logs", "//train", "/datasets", "/datasets/ds-1", "/weights"):
        assert required_token(path) == "api", path
    for path in ("/infer", "/v2/models/attention/infer", "/v2/models/attention/versions/1/infer"):
        assert required_token(path) == "infer", path
    for path in ("/gang", "/readyz", "/healthz", "/v2/models/attention", "/trainer", "/docs", ""):
        assert required_token(path) is None, path


# ---------------------------------------------------------------- through the service (real Ray, Serve, HTTP)


def assert_serves_correctly(base: str, headers: dict[str, str] | None = None) -> None:
    x = np.random.default_rng(7).standard_normal((1, 3, 512)).astype(np.float32)
    r = httpx.post(base + "/infer", content=valid_bodies(x)[wire.NPY],
                   headers={"content-type": wire.NPY, **(headers or {})}, timeout=60)
    assert r.status_code == 200, r.text
    assert relative_error(torch.from_numpy(np.load(io.BytesIO(r.content))), reference(x)) < 1e-5


def assert_typed_reply(r: httpx.Response) -> None:
    assert r.status_code < 500 or (r.status_code == 503 and r.headers.get("retry-after")), (r.status_code, r.text[:300])
    if r.status_code >= 400:
        doc = r.json()
        assert set(doc) == {"error", "code"} and doc["error"] and doc["code"], doc
        assert len(doc["error"]) <= MAX_MESSAGE_CHARS and not INTERNAL_TEXT.search(doc["error"]), doc


_X512 = np.random.default_rng(1).standard_normal((1, 2, 512)).astype(np.float32)
_VALID512 = {**valid_bodies(_X512), "oip-json": oip_body(_X512, False)[0], "oip-binary": oip_body(_X512, True)[0]}
_OIP_HEADER_LEN = oip_body(_X512, True)[1]


@pytest.fixture(scope="module")
def http(app_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=app_url, timeout=60) as client:
        yield client


def http_fuzz_request(client: httpx.Client, kind: str, body: bytes) -> httpx.Response:
    if kind.startswith("oip"):
        headers = {"content-type": "application/octet-stream" if kind == "oip-binary" else wire.JSON}
        if kind == "oip-binary":
            headers[OIP_HEADER_LENGTH] = str(_OIP_HEADER_LEN)
        return client.post(oip.router.prefix + "/models/attention/infer", content=body, headers=headers)
    return client.post("/infer", content=body, headers={"content-type": kind})


@deterministic(60)
@given(st.sampled_from(sorted(_VALID512)).flatmap(lambda kind: st.tuples(st.just(kind), mutated(_VALID512[kind]))))
@pytest.mark.ray
def test_http_fuzz_mutated_bodies_never_5xx(http: httpx.Client, case: tuple[str, bytes]) -> None:
    start = time.perf_counter()
    assert_typed_reply(http_fuzz_request(http, *case))
    assert time.perf_counter() - start < 30


@deterministic(40)
@given(st.one_of(npy_bodies().map(lambda b: (wire.NPY, b)), safetensors_bodies().map(lambda b: (wire.SAFETENSORS, b)),
                 json_bodies().map(lambda b: (wire.JSON, b)),
                 oip_requests().map(lambda r: ("oip-json", r[0]) if r[1] == "identity" and r[2] is None else (wire.JSON, r[0]))))
@pytest.mark.ray
def test_http_fuzz_generated_headers_never_5xx(http: httpx.Client, case: tuple[str, bytes]) -> None:
    assert_typed_reply(http_fuzz_request(http, *case))


@pytest.mark.ray
def test_service_answers_right_after_the_fuzzing(app_url: str) -> None:
    assert_serves_correctly(app_url)


@pytest.mark.parametrize("media, body, status, fragment", [
    (wire.NPY, npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (True, 512)}"), 400, "npy shape"),
    (wire.NPY, npy_file("{'descr': '<f16', 'fortran_order': False, 'shape': (1, 512)}", data=b"\0" * 16 * 512), 422, "float128"),
    (wire.NPY, npy_file("{'descr': '<c8', 'fortran_order': False, 'shape': (1, 512)}", data=b"\0" * 8 * 512), 422, "complex64"),
    (wire.NPY, npy_file("{'descr': [('a', '<f4', (2,))], 'fortran_order': False, 'shape': (1,)}"), 422, "structured"),
    (wire.JSON, b'{"hidden_states": [[1.0]], "dtype": {}}', 422, "dtype must be one of"),
    (wire.JSON, b'{"hidden_states": [[1.0]], "dtype": []}', 422, "dtype must be one of"),
    (wire.SAFETENSORS, (lambda h: struct.pack("<Q", len(h)) + h)(json.dumps(
        {"hidden_states": {"dtype": "F32", "shape": [0, 2**62], "data_offsets": [0, 0]}}).encode()), 422, "too large"),
], ids=["npy bool dim", "npy float128", "npy complex", "npy subarray", "json dtype {}", "json dtype []", "st huge dim"])
@pytest.mark.ray
def test_issue_crafts_are_4xx_over_http(http: httpx.Client, media: str, body: bytes, status: int, fragment: str) -> None:
    r = http.post("/infer", content=body, headers={"content-type": media})
    assert r.status_code == status and fragment in r.json()["error"], r.text
    assert_typed_reply(r)


def _cut_and_followed_by_the_next_request(body: bytes, media: str, cut: int) -> bytes:
    """`body` cut after `cut` bytes and completed, to its own length, by the next request on
    the connection: what a replica reads when the connection that carried the body lost its
    framing (the client's bytes were right; the front door's connection was not)."""
    following = (f"POST /infer HTTP/1.1\r\nhost: 127.0.0.1:8000\r\ncontent-type: {media}\r\n"
                 f"content-length: {len(body)}\r\n\r\n").encode() + body
    return body[:cut] + following[:len(body) - cut]


@pytest.mark.parametrize("media", [wire.NPY, wire.JSON])
@pytest.mark.ray
def test_a_body_mixed_with_the_next_request_is_a_retryable_503_not_the_clients_400(
        http: httpx.Client, media: str) -> None:
    """A valid request must never be blamed (4xx) for what its connection did to its body: a
    body that fails to decode and holds an HTTP request line is 503 incomplete_body; the same
    bytes without one stay the client's 400, naming what was found."""
    x = np.random.default_rng(7).standard_normal((1, 4, 512)).astype(np.float32)
    body = valid_bodies(x)[media]
    mixed = _cut_and_followed_by_the_next_request(body, media, cut=40)
    r = http.post("/infer", content=mixed, headers={"content-type": media})
    assert r.status_code == 503 and r.json()["code"] == "incomplete_body", r.text
    assert r.headers.get("retry-after"), r.headers
    garbled = mixed.replace(b" HTTP/1.1\r\n", b" HTTP/1.1\n\n")
    r = http.post("/infer", content=garbled, headers={"content-type": media})
    assert r.status_code == 400 and r.json()["code"] == "malformed", r.text
    if media == wire.NPY:
        error = r.json()["error"]
        assert "not a Python dict literal (" in error and "; got b\"{'descr'" in error, r.text
    assert_serves_correctly(str(http.base_url).rstrip("/"))


@pytest.mark.ray
def test_json_over_max_json_bytes_is_refused_before_it_is_read(http: httpx.Client) -> None:
    limit = SERVICE_LIMITS.max_json_bytes
    r = http.post("/infer", content=b" " * (limit + 1), headers={"content-type": wire.JSON})
    assert r.status_code == 413 and "max_json_bytes" in r.json()["error"]
    r = http.post("/v2/models/attention/infer", content=b" " * (limit + 1), headers={"content-type": wire.JSON})
    assert r.status_code == 413 and "max_json_bytes" in r.json()["error"]
    gz = gzip.compress(bomb("empty lists", 4 * limit), 9)  # ~100 KiB that inflates to 32 MiB
    r = http.post("/v2/models/attention/infer", content=gz, headers={"content-encoding": "gzip"})
    assert r.status_code == 413 and "max_json_bytes" in r.json()["error"], r.text


@pytest.mark.ray
def test_json_bombs_in_flight_leave_small_requests_served(app_url: str) -> None:
    """Bombs at the JSON limit, several at once, while small valid requests keep flowing:
    the bombs get 4xx (or 503 overloaded), every small request is answered right."""
    limit = SERVICE_LIMITS.max_json_bytes
    bombs = [bomb(kind, limit - 64) for kind in ("zeros", "empty lists", "nested rows", "strings")]
    done = threading.Event()
    bomb_statuses: list[int] = []

    def fire(body: bytes) -> None:
        with httpx.Client(timeout=120) as client:
            while not done.is_set():
                r = client.post(app_url + "/infer", content=body, headers={"content-type": wire.JSON})
                assert_typed_reply(r)
                bomb_statuses.append(r.status_code)

    latencies = []
    with ThreadPoolExecutor(len(bombs)) as pool:
        futures = [pool.submit(fire, body) for body in bombs]
        try:
            # The bomb streams are flowing (as many answered as there are streams) before the small requests.
            eventually(lambda: len(bomb_statuses) >= len(bombs) or any(f.done() for f in futures), 60,
                       f"{len(bombs)} JSON bombs answered")
            x = np.random.default_rng(3).standard_normal((1, 4, 512)).astype(np.float32)
            body = valid_bodies(x)[wire.NPY]
            with httpx.Client(timeout=60) as client:
                for _ in range(20):
                    start = time.perf_counter()
                    r = client.post(app_url + "/infer", content=body, headers={"content-type": wire.NPY})
                    latencies.append(time.perf_counter() - start)
                    assert r.status_code == 200, r.text
                    assert relative_error(torch.from_numpy(np.load(io.BytesIO(r.content))), reference(x)) < 1e-5
        finally:
            done.set()
        for future in futures:
            future.result()
    assert bomb_statuses and all(s in (413, 422, 503) for s in bomb_statuses), set(bomb_statuses)
    print(f"small requests next to {len(bombs)} JSON bomb streams ({len(bomb_statuses)} bombs answered): "
          f"p50 {1000 * float(np.median(latencies)):.0f} ms, max {1000 * max(latencies):.0f} ms")


# -- auth

# The 401 matrix of every guarded route: tests/test_auth.py (in-process).

@pytest.mark.ray
def test_reads_work_with_the_token(http: httpx.Client) -> None:
    assert http.get("/train", headers=AUTH).status_code == 200
    assert http.get("/datasets", headers=AUTH).status_code == 200
    assert http.get("/train/job-0123abcd4567", headers=AUTH).status_code == 404


def _raw_post_headers_only(base: str, path: str, declared: int, headers: dict[str, str]) -> tuple[int, float]:
    """POST with a huge Content-Length but only the headers (and 1 KiB) sent: (status, seconds).
    A server that read the body before answering would time out here."""
    url = urlsplit(base)
    with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
        lines = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", f"Content-Length: {declared}",
                 *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        start = time.perf_counter()
        sock.sendall("\r\n".join(lines).encode() + b"{" * 1024)
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        return int(reply.split(b" ", 2)[1]), time.perf_counter() - start


@pytest.mark.parametrize("path", ["/weights", "/datasets", "/train"])
@pytest.mark.ray
def test_auth_is_checked_before_the_body_is_read(app_url: str, path: str) -> None:
    status, seconds = _raw_post_headers_only(app_url, path, 300 * 1024 * 1024, {"content-type": wire.JSON})
    assert status == 401 and seconds < 15
    status, seconds = _raw_post_headers_only(app_url, path, 300 * 1024 * 1024,
                                             {"content-type": wire.JSON, "authorization": "Bearer wrong"})
    assert status == 401 and seconds < 15


@pytest.mark.ray
def test_openapi_declares_the_bearer_schemes(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    schemes = doc["components"]["securitySchemes"]
    assert schemes["APIToken"] == {**schemes["APIToken"], "type": "http", "scheme": "bearer"}
    assert schemes["InferenceToken"]["scheme"] == "bearer"
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if required_token(path.split("{")[0].rstrip("/") or path) == "api":
                assert {"APIToken": []} in op.get("security", []), (method, path)
    assert doc["paths"]["/infer"]["post"]["security"] == [{"InferenceToken": []}, {}]
    assert "401" in doc["paths"]["/infer"]["post"]["responses"]


# -- a second app: a checkpoint path, the inference token

@pytest.fixture(scope="module")
def hard_url(serve_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve
    from ray.serve.deployment import Application

    from service.app import compose_app, parse_args
    from service.parallel.weights import save_checkpoint, seed_weights

    checkpoint = tmp_path_factory.mktemp("hardening-weights") / "seed.safetensors"
    save_checkpoint(checkpoint, seed_weights(512), num_heads=8)
    cfg = parse_args(suite_args({**local_yaml_args(), "world_size": 1, "cpus_per_rank": 0.5,
                                 "checkpoint": str(checkpoint), "max_json_bytes": 1 << 20}))
    app = compose_app(cfg)
    # The same app, with GANGSERVE_INFER_TOKEN in the ingress's environment only.
    ingress = app._bound_deployment
    actor_options = {**(ingress.ray_actor_options or {}),
                     "runtime_env": {"env_vars": {"GANGSERVE_INFER_TOKEN": INFER_TOKEN}}}
    serve.run(Application(ingress.options(ray_actor_options=actor_options)), name="hardened",
              route_prefix="/hardened", blocking=False)
    base = wait_ready(serve_url + "/hardened", 180, "app 'hardened'")
    yield base
    undeploy("hardened")


@pytest.mark.ray
def test_inference_token_when_set(hard_url: str) -> None:
    x = _X512
    oip_json, _ = oip_body(x, False)
    for path, body, media in (("/infer", valid_bodies(x)[wire.NPY], wire.NPY),
                              ("/v2/models/attention/infer", oip_json, wire.JSON),
                              ("/v2/models/attention/versions/1/infer", oip_json, wire.JSON)):
        r = httpx.post(hard_url + path, content=body, headers={"content-type": media}, timeout=60)
        assert r.status_code == 401, (path, r.text)  # the ingress's environment sets the token (the matrix: test_auth)
        for token in (INFER_TOKEN, TEST_API_TOKEN):  # the API token is accepted too
            r = httpx.post(hard_url + path, content=body, timeout=60,
                           headers={"content-type": media, "authorization": f"Bearer {token}"})
            assert r.status_code == 200, (path, r.text)
    assert_serves_correctly(hard_url, {"authorization": f"Bearer {INFER_TOKEN}"})
    # Metadata and health stay open.
    assert httpx.get(hard_url + "/v2/models/attention", timeout=30).status_code == 200
    assert httpx.get(hard_url + "/v2/health/ready", timeout=30).status_code == 200


@pytest.mark.ray
def test_gang_shows_no_paths_without_the_api_token(hard_url: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    public = httpx.get(hard_url + "/gang", timeout=30)
    assert public.status_code == 200
    text = public.text
    for secret in (str(tmp_path_factory.getbasetemp()), os.environ["GANGSERVE_STATE_DIR"]):
        assert secret not in text
    assert not re.search(r'"(~|\.{1,2})?/[^/"]', text), text  # no string value that starts like a path
    full = httpx.get(hard_url + "/gang", headers=AUTH, timeout=30)
    assert full.status_code == 200 and full.json()["world_size"] == public.json()["world_size"] == 1
