"""Codec properties (no Ray): round trips against independent writers/readers, and hardening.

References: the `safetensors` library (numpy and torch flavours), numpy's own np.save /
np.load, torch's bfloat16 rounding, and the stdlib json module.
"""
from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from gangserve_client import codecs as wire
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors.numpy import load as st_load_np
from safetensors.numpy import save as st_save_np
from safetensors.torch import load as st_load_torch
from safetensors.torch import save as st_save_torch

from service.ingress import codecs
from service.contract.errors import BadRequest, GangServeError, InvalidInput

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
DTYPES = ["float16", "bfloat16", "float32", "float64"]


@st.composite
def float_arrays(draw: st.DrawFn, dtypes: list[str] = DTYPES, max_dims: int = 4) -> np.ndarray:
    """Finite arrays of random shape (zero-size dims included) in one of the wire dtypes."""
    name = draw(st.sampled_from(dtypes))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=0, max_side=6))
    if name == "bfloat16":  # hypothesis has no bfloat16: draw float32 and round
        finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32).filter(lambda v: abs(v) < 3e38)
        base = draw(hnp.arrays(np.float32, shape, elements=finite32))
        return base.astype(ml_dtypes.bfloat16)
    width = {"float16": 16, "float32": 32, "float64": 64}[name]
    return draw(hnp.arrays(np.dtype(name), shape, elements=st.floats(allow_nan=False, allow_infinity=False, width=width)))


def same(a: np.ndarray, b: np.ndarray) -> None:
    """Same dtype, shape and bits (so -0.0 and 0.0 differ, as they should on the wire)."""
    assert wire.dtype_name(a.dtype) == wire.dtype_name(b.dtype)
    assert a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def torch_of(a: np.ndarray) -> torch.Tensor:
    if a.dtype == codecs.BFLOAT16:
        return torch.from_numpy(np.require(a, requirements="C").view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def tensor_bits(t: torch.Tensor) -> bytes:
    """Row-major bytes of a torch tensor (bfloat16 included, via a same-size integer view)."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(as_int).numpy().tobytes()


# ---------------------------------------------------------------- round trips

@SETTINGS
@given(float_arrays())
def test_safetensors_round_trip_and_library_agreement(a: np.ndarray) -> None:
    ours = wire.encode_safetensors({"hidden_states": a})
    same(codecs.decode(ours, wire.SAFETENSORS), a)
    # Our bytes read by the reference library (torch flavour: it knows bfloat16) ...
    theirs = st_load_torch(ours)["hidden_states"]
    assert theirs.shape == a.shape and theirs.dtype == torch_of(a).dtype
    assert tensor_bits(theirs) == a.tobytes()
    # ... and the library's bytes read by us.
    same(codecs.decode(st_save_torch({"hidden_states": torch_of(a).contiguous()}), wire.SAFETENSORS), a)
    if a.dtype != codecs.BFLOAT16:
        same(codecs.decode(st_save_np({"hidden_states": a}), wire.SAFETENSORS), a)
        same(st_load_np(ours)["hidden_states"], a)


@SETTINGS
@given(float_arrays(dtypes=["float16", "float32", "float64"]), st.booleans())
def test_npy_round_trip_and_numpy_agreement(a: np.ndarray, fortran: bool) -> None:
    a = np.asfortranarray(a) if fortran else a
    ours = wire.encode_npy(a)
    same(np.load(io.BytesIO(ours), allow_pickle=False), a)
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    same(codecs.decode(buf.getvalue(), wire.NPY), a)


@SETTINGS
@given(float_arrays())
def test_json_round_trip_and_stdlib_agreement(a: np.ndarray) -> None:
    body = wire.encode_json(a, name="hidden_states")
    same(codecs.decode(body, wire.JSON), a)
    doc = json.loads(body)  # independent parser: shape, dtype name and values
    assert doc["shape"] == list(a.shape) and doc["dtype"] == wire.dtype_name(a.dtype)
    # JSON holds the shortest decimal that reads back as the same value at a's precision.
    same(np.asarray(doc["hidden_states"], dtype=np.float64).astype(a.dtype).reshape(a.shape), a)


@SETTINGS
@given(float_arrays(max_dims=3), st.booleans())
def test_oip_tensor_round_trip(a: np.ndarray, nested: bool) -> None:
    datatype = codecs.oip_datatype(a.dtype)
    raw = bytes(codecs.raw_bytes(a))
    assert raw == np.ascontiguousarray(a).tobytes()
    same(codecs.decode_oip_tensor(datatype, list(a.shape), raw=raw, name="x"), a)
    # JSON data as a client writes it: float64 holds every wire dtype's values exactly.
    data = json.loads(json.dumps(a.astype(np.float64).reshape(-1).tolist()))
    if nested and a.ndim and a.size:
        data = np.asarray(data).reshape(a.shape).tolist()
    same(codecs.decode_oip_tensor(datatype, list(a.shape), data=data, name="x"), a)


@SETTINGS
@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=8),
                  elements=st.floats(allow_nan=False, allow_infinity=False, width=32)))
def test_reply_casts_round_like_torch(a: np.ndarray) -> None:
    """float32 -> bfloat16 / float16 replies: round-to-nearest-even, as torch does."""
    for dtype, tdtype in ((codecs.BFLOAT16, torch.bfloat16), (np.dtype(np.float16), torch.float16)):
        got = codecs.cast_reply(a, dtype)
        want = torch.from_numpy(a).to(tdtype)
        assert torch.equal(torch_of(got), want) or torch.equal(torch_of(got).isnan(), want.isnan())


def test_half_inputs_are_computed_from_exact_float32_values() -> None:
    a = np.array([[1.5, -2.25, 1000.0, 6.0e-5]], np.float32)
    for dtype in (codecs.BFLOAT16, np.dtype(np.float16)):
        x = a.astype(dtype)
        got = codecs.to_model_input(x)
        assert got.dtype == np.float32 and got.shape == (1, 1, 4) and got.flags.c_contiguous
        assert np.array_equal(got[0], torch_of(x).float().numpy())


# ---------------------------------------------------------------- hardening

MEDIA = [wire.SAFETENSORS, wire.NPY, wire.JSON]


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.sampled_from(MEDIA), st.binary(max_size=512))
def test_random_bytes_raise_only_typed_errors(media: str, body: bytes) -> None:
    try:
        array = codecs.decode(body, media)
    except GangServeError as exc:
        assert exc.status in (400, 422) and exc.message and len(exc.message) <= 1000
        return
    try:
        codecs.validate_hidden_states(array, embed_dim=4, max_seq_len=8, max_tokens=16)
    except InvalidInput:
        pass


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_mutated_safetensors_headers_raise_only_typed_errors(data: st.DataObject) -> None:
    """Random header JSON (lying offsets, shapes, dtypes) over a real buffer: 400/422, never a crash."""
    buffer = np.arange(64, dtype=np.float32).tobytes()
    entry = {
        "dtype": data.draw(st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "Q9", 3, None, {}, []])),
        "shape": data.draw(st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), st.just("x"))),
        "data_offsets": data.draw(st.one_of(st.lists(st.integers(-10, 2**63), max_size=3), st.none())),
    }
    header = json.dumps({"hidden_states": entry}).encode()
    body = struct.pack("<Q", len(header)) + header + buffer
    try:
        array = codecs.decode(body, wire.SAFETENSORS)
    except (BadRequest, InvalidInput) as exc:
        assert exc.message
    else:  # whatever was accepted is exactly inside the buffer
        assert array.nbytes <= len(buffer)


@pytest.mark.parametrize("body, status, fragment", [
    (b"\x01\x00", 400, "at least an 8-byte"),
    ((2**40).to_bytes(8, "little") + b"{}", 400, "header claims"),
    ((wire.MAX_SAFETENSORS_HEADER + 1).to_bytes(8, "little") + b" " * (wire.MAX_SAFETENSORS_HEADER + 1), 400, "limit"),
    (struct.pack("<Q", 2) + b"[]", 400, "JSON object"),
    (struct.pack("<Q", 5) + b"{oops", 400, "not valid JSON"),
], ids=["short", "lying length", "header over cap", "not an object", "bad json"])
def test_safetensors_header_errors(body: bytes, status: int, fragment: str) -> None:
    with pytest.raises(GangServeError) as info:
        codecs.decode(body, wire.SAFETENSORS)
    assert info.value.status == status and fragment in info.value.message


def test_safetensors_offsets_are_bounds_checked() -> None:
    good = wire.encode_safetensors({"hidden_states": np.ones((2, 4), np.float32)})
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + n])
    header["hidden_states"]["data_offsets"] = [4, 36]  # one float past the end
    text = json.dumps(header).encode()
    with pytest.raises(BadRequest, match="within the 32-byte buffer"):
        codecs.decode(struct.pack("<Q", len(text)) + text + good[8 + n:], wire.SAFETENSORS)
    header["hidden_states"]["data_offsets"] = [0, 16]  # too short for [2, 4] F32
    text = json.dumps(header).encode()
    with pytest.raises(BadRequest, match="needs 32"):
        codecs.decode(struct.pack("<Q", len(text)) + text + good[8 + n:], wire.SAFETENSORS)


def test_binary_decoding_is_zero_copy() -> None:
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for body, media in ((wire.encode_safetensors({"hidden_states": a}), wire.SAFETENSORS),
                        (wire.encode_npy(a), wire.NPY)):
        out = codecs.decode(body, media)
        assert not out.flags.owndata and not out.flags.writeable  # a view of the request body
        assert np.array_equal(out, a)


# Printable characters but the quotes and the backslash (repr writes those with escapes).
_PRINTABLE = st.characters(min_codepoint=32, max_codepoint=126, blacklist_characters="\\'\"")
# Python literals of the npy header's grammar: what numpy writes, and the nesting a structured descr has.
_literal_leaves = st.one_of(st.integers(-2**70, 2**70), st.booleans(), st.none(),
                            st.text(_PRINTABLE, max_size=6))
header_literals = st.recursive(_literal_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
    st.dictionaries(st.one_of(st.text(_PRINTABLE, max_size=6),
                              st.integers(-9, 9)), inner, max_size=4)), max_leaves=12)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(header_literals)
def test_npy_header_literals_read_as_python_reads_them(value: object) -> None:
    """The npy header's own parser (no `ast`) reads every literal of its grammar as Python's
    `ast.literal_eval` does (the independent reference), in numpy's spelling and a spaced one."""
    import ast

    from gangserve_client.codecs import _Literal

    text = repr(value)
    assert _Literal(text).parse() == ast.literal_eval(text) == value
    spaced = text.replace(",", " ,  ").replace("(", "( ").replace(":", " : ")
    assert _Literal(spaced).parse() == ast.literal_eval(spaced)


@pytest.mark.parametrize("text", ["(0, 2**70)", "{'a': 1.5}", "'a' 'b'", "{'a': 1,, }", "[1, 2", "(1 2)", "x",
                                  "{'a': '\\x41'}", "(" * 20 + ")" * 20, "{1: 2}}", "1e3", "()()"])
def test_npy_header_parser_refuses_what_is_not_a_plain_literal(text: str) -> None:
    from gangserve_client.codecs import _Literal

    with pytest.raises(ValueError):
        _Literal(text).parse()


def test_npy_headers_decode_while_other_threads_build_asts() -> None:
    """CPython 3.11's AST builder keeps its recursion depth in one per-interpreter counter, so
    `ast.literal_eval` racing another thread's `ast.parse` (the traceback module's, placing its
    carets, in any thread that formats an exception) can fail on a valid header; a garbage
    collection run inside the builder (a finalizer here) is the thread switch. Seen as a correct
    request answered 400 `malformed` during the fault tests. The header parser builds no AST."""
    import ast
    import gc
    import threading
    import time

    class Cycle:  # freed by the collector only; its finalizer runs Python code: a switch point
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            time.sleep(0)

    stop = threading.Event()
    raced: list[BaseException] = []

    def build_asts() -> None:
        source = "x = f(a[1], g(2, 3)) + {'k': (1, 2, [3, 4])}\n" * 20
        while not stop.is_set():
            try:
                ast.parse(source)
            except SystemError as exc:  # the race, hit by this thread instead
                raced.append(exc)
            [Cycle() for _ in range(20)]

    body = wire.encode_npy(np.ones((1, 4, 512), np.float32))
    thresholds = gc.get_threshold()
    gc.set_threshold(50, 5, 5)
    threads = [threading.Thread(target=build_asts, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(5_000):
            assert wire.decode_npy(body).shape == (1, 4, 512)
            [Cycle() for _ in range(5)]
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        gc.set_threshold(*thresholds)
    print(f"the AST race hit the other threads {len(raced)} times")
    # The race hits a short conversion (a header's) rarely enough that a loop cannot show it
    # reliably: so the codec must not reach for the AST builder at all.
    source = Path(wire.__file__).read_text()
    assert "literal_eval(" not in source and "import ast" not in source


def test_npy_never_unpickles() -> None:
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InvalidInput, match="pickled"):
        codecs.decode(buf.getvalue(), wire.NPY)
    with pytest.raises(BadRequest, match="needs"):
        codecs.decode(wire.encode_npy(np.ones((2, 2), np.float32))[:-1], wire.NPY)


@pytest.mark.parametrize("body, fragment", [
    (b'{"hidden_states": [["a", "b"]]}', "only numbers"),
    (b'{"hidden_states": [[true, false]]}', "only numbers"),
    (b'{"hidden_states": [[null]]}', "only numbers"),
    (b'{"hidden_states": [[1.0], [1.0, 2.0]]}', "rectangular"),
    (b'{"hidden_states": [[1.0]], "dtype": "int8"}', "dtype must be one of"),
    (b'[1, 2]', "must be an object"),
], ids=["strings", "bools", "null", "ragged", "bad dtype", "not an object"])
def test_json_content_errors_are_422(body: bytes, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        codecs.decode(body, wire.JSON)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_are_refused_in_every_dtype(dtype: str, bad: float) -> None:
    x = np.zeros((1, 2, 4), np.float32)
    x[0, 1, 2] = bad
    with pytest.raises(InvalidInput, match="NaN or Inf"):
        codecs.validate_hidden_states(x.astype(wire.FLOAT_DTYPES[dtype]), embed_dim=4, max_seq_len=8, max_tokens=16)


def test_float64_beyond_float32_and_json_beyond_float16_are_refused() -> None:
    with pytest.raises(InvalidInput, match="overflow float32"):
        codecs.validate_hidden_states(np.full((1, 4), 1e300), embed_dim=4, max_seq_len=8, max_tokens=16)
    array = codecs.decode(b'{"hidden_states": [[70000.0, 0, 0, 0]], "dtype": "float16"}', wire.JSON)
    with pytest.raises(InvalidInput, match="NaN or Inf"):
        codecs.validate_hidden_states(array, embed_dim=4, max_seq_len=8, max_tokens=16)


@pytest.mark.parametrize("shape, fragment", [
    ((1, 9, 4), "max_seq_len=8"),
    ((3, 6, 4), "max_tokens_per_request=16"),
    ((1, 2, 5), "embed_dim=4"),
    ((1, 1, 2, 4), "got shape [1, 1, 2, 4]"),
    ((0, 4), "must not be empty"),
])
def test_shape_limits(shape: tuple[int, ...], fragment: str) -> None:
    with pytest.raises(InvalidInput) as info:
        codecs.check_shape(shape, embed_dim=4, max_seq_len=8, max_tokens=16)
    assert fragment in info.value.message


def test_reply_dtype_rule() -> None:
    f16 = np.dtype(np.float16)
    assert codecs.reply_dtype(f16, None) == f16
    assert codecs.reply_dtype(f16, "float32") == np.float32
    assert codecs.reply_dtype(np.dtype(np.float32), "bfloat16", wire.SAFETENSORS) == codecs.BFLOAT16
    with pytest.raises(InvalidInput, match="npy cannot carry bfloat16"):
        codecs.reply_dtype(codecs.BFLOAT16, None, wire.NPY)
