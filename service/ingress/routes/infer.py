"""POST /infer: one tensor in, the attention output out, in the caller's wire format."""
from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request, Response

from service import codecs
from service.config import AppConfig
from service.ingress.deps import get_config, get_gang, read_body_capped
from service.ingress.schemas import ERROR_RESPONSES
from service.ingress.gang_client import GangClient

router = APIRouter(tags=["inference"])

_BINARY = {"type": "string", "format": "binary"}
_DTYPE = {"type": "string", "enum": list(codecs.DTYPE_NAMES)}
_BODY_DOC = {
    "required": True,
    "description": "hidden_states [batch, seq, E] or [seq, E] in float32, float16, bfloat16 or float64 "
    "(npy cannot carry bfloat16). Computed in float32.",
    "content": {
        codecs.SAFETENSORS: {"schema": {**_BINARY, "description": "safetensors file with a tensor 'hidden_states'"}},
        codecs.NPY: {"schema": {**_BINARY, "description": "npy file (never unpickled)"}},
        codecs.JSON: {
            "schema": {
                "type": "object",
                "required": ["hidden_states"],
                "properties": {
                    "hidden_states": {"type": "array", "items": {}, "description": "nested lists of numbers"},
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
    openapi_extra={"requestBody": _BODY_DOC},
    response_class=Response,
    responses={200: _REPLY_DOC, **ERROR_RESPONSES},
)
async def infer(
    request: Request,
    output_dtype: Literal["float32", "float16", "bfloat16", "float64"] | None = Query(
        None, description="Reply dtype; default: the request's dtype (npy replies cannot be bfloat16)."
    ),
    cfg: AppConfig = Depends(get_config),
    gang: GangClient = Depends(get_gang),
) -> Response:
    media = codecs.media_type_of(request.headers.get("content-type"))
    reply_media = codecs.negotiate(request.headers.get("accept"), media)
    t_start = time.perf_counter()
    body = await read_body_capped(request, cfg.max_body_bytes)
    t_read = time.perf_counter()
    array = codecs.decode(body, media)
    dtype = codecs.reply_dtype(array.dtype, output_dtype, reply_media)
    x, squeezed = codecs.validate_hidden_states(
        array,
        embed_dim=cfg.embed_dim,
        max_seq_len=cfg.max_seq_len,
        max_tokens=cfg.max_tokens_per_request,
    )
    t_decoded = time.perf_counter()
    out = await gang.infer(x)  # [batch, seq, E] float32
    t_gang = time.perf_counter()
    if squeezed:
        out = out[0]
    content = codecs.encode(codecs.cast_reply(out, dtype), reply_media)
    t_end = time.perf_counter()
    # Where the time went, for clients and `make bench` (W3C Server-Timing, milliseconds).
    timing = ", ".join(
        f"{name};dur={(b - a) * 1000:.2f}"
        for name, a, b in (("read", t_start, t_read), ("decode", t_read, t_decoded),
                           ("gang", t_decoded, t_gang), ("encode", t_gang, t_end))
    )
    return Response(content=content, media_type=reply_media, headers={"Server-Timing": timing})
