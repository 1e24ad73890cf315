"""POST /infer: one tensor in, the attention output out, in the caller's wire format."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from service import codecs
from service.config import AppConfig
from service.ingress.deps import get_config, get_gang, read_body_capped
from service.ingress.gang_client import GangClient

router = APIRouter(tags=["inference"])

_BODY_DOC = {
    "required": True,
    "content": {
        codecs.SAFETENSORS: {"schema": {"type": "string", "format": "binary"}},
        codecs.NPY: {"schema": {"type": "string", "format": "binary"}},
        codecs.JSON: {
            "schema": {
                "type": "object",
                "required": ["hidden_states"],
                "properties": {"hidden_states": {"type": "array", "items": {}}},
            }
        },
    },
}


@router.post(
    "/infer",
    summary="Self-attention over hidden_states [batch, seq, E] or [seq, E]",
    openapi_extra={"requestBody": _BODY_DOC},
    responses={
        200: {"content": {codecs.SAFETENSORS: {}, codecs.NPY: {}, codecs.JSON: {}}},
        400: {"description": "malformed body"},
        413: {"description": "body too large"},
        415: {"description": "unsupported Content-Type"},
        422: {"description": "wrong shape, dtype, name or non-finite values"},
        503: {"description": "gang not ready or overloaded (Retry-After)"},
        504: {"description": "collective deadline exceeded"},
    },
)
async def infer(
    request: Request,
    cfg: AppConfig = Depends(get_config),
    gang: GangClient = Depends(get_gang),
) -> Response:
    media = codecs.media_type_of(request.headers.get("content-type"))
    reply_media = codecs.negotiate(request.headers.get("accept"), media)
    body = await read_body_capped(request, cfg.max_body_bytes)
    x, squeezed = codecs.validate_hidden_states(
        codecs.decode(body, media),
        embed_dim=cfg.embed_dim,
        max_seq_len=cfg.max_seq_len,
        max_tokens=cfg.max_tokens_per_request,
    )
    out = await gang.infer(x)  # [batch, seq, E]
    if squeezed:
        out = out[0]
    return Response(content=codecs.encode(out, reply_media), media_type=reply_media)
