"""POST /infer: one tensor in, the attention output out, in the caller's wire format.

Bounded before it is decoded: the body by max_body_bytes (JSON: max_json_bytes), refused
from Content-Length before it is read; the declared shape by max_seq_len /
max_tokens_per_request before any value is converted. Bodies over tunables.ingress.inline_decode_bytes are
decoded in the ingress's DecodePool (never on the event loop; 503 `overloaded` when it is
full), smaller ones inline (they cost less than the hop to a thread).
"""
from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request, Response

import numpy as np

from service.contract import deadlines
from service.contract.timing import Part
from service.metrics import timeline
from service.ingress import codecs
from service.ingress.auth import inference_auth
from service.config.builder_args import AppConfig
from service.ingress.deps import (
    DecodePool, check_declared_length, get_config, get_decode_pool,
    Gang, get_gang, read_body_capped,
)

from service.ingress.schemas import INFER_ERROR_RESPONSES, OPTIONAL_INFER_SECURITY

router = APIRouter(tags=["inference"], dependencies=[Depends(inference_auth)])

_BINARY = {"type": "string", "format": "binary"}
_DTYPE = {"type": "string", "enum": list(codecs.DTYPE_NAMES)}
_BODY_DOC = {
    "required": True,
    "description": "hidden_states [batch, seq, E] or [seq, E] in float32, float16, bfloat16 or float64 "
    "(npy cannot carry bfloat16), and optionally (JSON, safetensors) attention_mask [batch, seq] or [seq]: "
    "1 = token, 0 = padding. Computed in the app's compute_dtype (default float32).",
    "content": {
        codecs.SAFETENSORS: {"schema": {**_BINARY, "description": "safetensors file with a tensor 'hidden_states' "
                                        "and optionally 'attention_mask' (BOOL, U8, I32 or I64)"}},
        codecs.NPY: {"schema": {**_BINARY, "description": "npy file (never unpickled); one array, so no mask"}},
        codecs.JSON: {
            "schema": {
                "type": "object",
                "required": ["hidden_states"],
                "properties": {
                    "hidden_states": {"type": "array", "items": {}, "description": "nested lists of numbers"},
                    "attention_mask": {"type": "array", "items": {},
                                       "description": "optional [batch, seq] (or [seq]) of 1 = token, 0 = padding"},
                    "dtype": {**_DTYPE, "default": "float32", "description": "the request's dtype"},
                    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0},
                              "description": "optional; hidden_states (flat or nested) is reshaped to it"},
                },
            }
        },
    },
}
_REPLY_DOC = {
    "description": "the attention output, same shape as hidden_states, in the negotiated format and dtype",
    "content": {
        codecs.SAFETENSORS: {"schema": {**_BINARY, "description": "safetensors file with a tensor 'output'"}},
        codecs.NPY: {"schema": {**_BINARY, "description": "npy file"}},
        codecs.JSON: {
            "schema": {
                "type": "object",
                "required": ["output", "shape", "dtype"],
                "properties": {
                    "output": {"type": "array", "items": {}},
                    "shape": {"type": "array", "items": {"type": "integer"}},
                    "dtype": _DTYPE,
                },
            }
        },
    },
}


@router.post(
    "/infer",
    summary="Self-attention over hidden_states [batch, seq, E] or [seq, E]",
    openapi_extra={"requestBody": _BODY_DOC, **OPTIONAL_INFER_SECURITY},
    response_class=Response,
    responses={200: _REPLY_DOC, **INFER_ERROR_RESPONSES},
)
async def infer(
    request: Request,
    output_dtype: Literal["float32", "float16", "bfloat16", "float64"] | None = Query(
        None, description="Reply dtype; default: the request's dtype (npy replies cannot be bfloat16)."
    ),
    causal: bool | None = Query(
        None, description="Causal attention (query i attends keys j <= i); default: the served model's "
        "(the checkpoint's recorded `causal`, else the builder's `causal`)."
    ),
    cfg: AppConfig = Depends(get_config),
    gang: Gang = Depends(get_gang),
    pool: DecodePool = Depends(get_decode_pool),
) -> Response:
    started = time.monotonic()  # the deadline counts from here (service.contract.deadlines)
    deadline = deadlines.request_deadline(
        started, cfg.serving.request_timeout_s, deadlines.header_timeout(request.headers.get(deadlines.HEADER)),
        tunables=cfg.tunables.ingress)
    media = codecs.media_type_of(request.headers.get("content-type"))
    reply_media = codecs.negotiate(request.headers.get("accept"), media)
    # Where the time goes (service.metrics.timeline): the link and the GangServer mark their
    # parts on this request's timeline; the reply's Server-Timing lists every part.
    marks = timeline.Timeline.starting_now()
    token = timeline.start(marks)
    try:
        check_declared_length(request, cfg.serving.max_body_bytes)
        if media == codecs.JSON:
            body = await read_body_capped(request, cfg.serving.max_json_bytes, "max_json_bytes")
        else:
            body = await read_body_capped(request, cfg.serving.max_body_bytes)
        marks.mark(Part.READ)
        limits = codecs.Limits.of(cfg)
        x, mask, squeezed, dtype = await pool.decode(_prepare, body, media, limits, output_dtype, reply_media,
                                                     inline=len(body) <= cfg.tunables.ingress.inline_decode_bytes)
        marks.mark(Part.DECODE)
        out = await gang.infer(x, mask, causal, deadline)  # [batch, seq, E] float32
        # Over the data channel the link marked its parts and the GangServer's; otherwise the
        # whole hop is one part.
        marks.mark(Part.RETURN if marks.marks[-1][0] is Part.LINK_RECEIVE else Part.GANG)
        if squeezed:
            out = out[0]
        if out.size > cfg.tunables.ingress.inline_encode_values:
            content = await pool.run_unbounded(_encode, out, dtype, reply_media)
        else:
            content = _encode(out, dtype, reply_media)
        marks.mark(Part.ENCODE)
    finally:
        timeline.reset(token)
    return Response(content=content, media_type=reply_media, headers={"Server-Timing": marks.server_timing()})


def _prepare(
    body: bytes, media: str, limits: codecs.Limits, output_dtype: str | None, reply_media: str
) -> tuple[np.ndarray, np.ndarray | None, bool, np.dtype]:
    """Decode (shape and dtype checked before any value is converted), pick the reply dtype,
    and bring the tensor to [batch, seq, E] float32 and the mask to [batch, seq] bool:
    (x, mask or None, squeezed, reply dtype)."""
    array, raw_mask = codecs.decode_request(body, media, limits)
    dtype = codecs.reply_dtype(array.dtype, output_dtype, reply_media)
    x, squeezed = codecs.validate_hidden_states(
        array, embed_dim=limits.embed_dim, max_seq_len=limits.max_seq_len, max_tokens=limits.max_tokens
    )
    return x, codecs.validate_attention_mask(raw_mask, x.shape, squeezed), squeezed, dtype


def _encode(out: np.ndarray, dtype: np.dtype, reply_media: str) -> bytes:
    return codecs.encode(codecs.cast_reply(out, dtype), reply_media)
