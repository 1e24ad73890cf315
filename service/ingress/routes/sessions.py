"""Stateful sessions (issue 31): POST /sessions, POST /sessions/{id}/append, GET and DELETE /sessions/{id}.

Bodies are what POST /infer takes (safetensors, npy, JSON; the same limits, auth and
deadlines): the rows `[n, E]` or `[1, n, E]`; an `attention_mask` is refused (422: a
session's rows are all tokens, and its causal order is the mask). Replies carry the outputs
of the new rows in the negotiated format, and the session's state in headers
(`X-Session-Id`, `X-Session-Length`, `X-Weights-Version`: the version every row of this
answer was computed with, `X-Recomputed-Tokens`); a JSON reply also has `session_id`,
`length` and `weights_version` next to `output`, and the whole state under `session`.
Bad input changes no state: it is refused here, before the gang server sees it, or there
before the append is queued (unknown session, past `max_session_tokens`).

Exactly once: an append's `Idempotency-Key` header (service.sessions.keys; 422
`invalid_request` when it is not 1-128 visible ASCII characters) goes with every try the
ingress makes; without one the request policy makes one. A retry with the key of an append
the session remembers answers that append's answer again, with `Idempotent-Replayed: true`,
and appends nothing; the same key with other rows is 409 `idempotency_key_reused`.
"""
from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from service.contract import deadlines
from service.contract.timing import Part
from service.metrics import timeline
from service.config.builder_args import AppConfig
from service.contract.errors import InvalidInput
from service.ingress import codecs
from service.ingress.auth import inference_auth
from service.ingress.retries import GangMethod
from service.ingress.deps import (
    DecodePool, Gang, check_declared_length, get_config, get_decode_pool, get_gang, read_body_capped,
)

from service.ingress.routes.infer import _encode
from service.sessions import keys
from service.ingress.schemas import INFER_ERROR_RESPONSES, OPTIONAL_INFER_SECURITY

router = APIRouter(tags=["sessions"], dependencies=[Depends(inference_auth)])

_DtypeName = Literal["float32", "float16", "bfloat16", "float64"]
_OutputDtype = Query(None, description="Reply dtype; default: the request's dtype.")


@router.post("/sessions", summary="Open a session (optional body: its first rows, a prefill)",
             response_class=Response, openapi_extra=OPTIONAL_INFER_SECURITY, responses=INFER_ERROR_RESPONSES,
             status_code=201)
async def open_session(request: Request, output_dtype: _DtypeName | None = _OutputDtype,
                       cfg: AppConfig = Depends(get_config), gang: Gang = Depends(get_gang),
                       pool: DecodePool = Depends(get_decode_pool)) -> Response:
    deadline = _deadline(request, cfg)
    decoded = await _rows(request, cfg, pool, output_dtype, optional=True)
    if decoded is None:
        _, info = await gang.session_call(GangMethod.SESSION_OPEN, None, session_id=None, deadline=deadline)
        return JSONResponse(info, status_code=201, headers=_headers(info))
    x, dtype, media, squeezed = decoded
    out, info = await gang.session_call(GangMethod.SESSION_OPEN, x, session_id=None, deadline=deadline)
    return _reply(out if squeezed else out[None], info, dtype, media, 201)


@router.post("/sessions/{session_id}/append", summary="Append rows [n, E] to a session: their outputs",
             response_class=Response, openapi_extra=OPTIONAL_INFER_SECURITY, responses=INFER_ERROR_RESPONSES)
async def append(session_id: str, request: Request, output_dtype: _DtypeName | None = _OutputDtype,
                 length: int | None = Query(None, ge=0, description="Precondition: the session's length before "
                                            "this append (409 `session_length_mismatch` otherwise): a safe retry."),
                 idempotency_key: str | None = Header(
                     None, alias=keys.HEADER, description="This append's key (1-128 visible ASCII characters, e.g. "
                     "a uuid4), new for each append and the same on its retries: a retry the session remembers gets "
                     "the first answer (`Idempotent-Replayed: true`) and appends nothing. Without one the service "
                     "makes one, which covers its own retries only."),
                 cfg: AppConfig = Depends(get_config), gang: Gang = Depends(get_gang),
                 pool: DecodePool = Depends(get_decode_pool)) -> Response:
    deadline = _deadline(request, cfg)
    key = keys.key_of(idempotency_key, keys.HEADER)  # checked before the body is read
    # Where the append's time goes (service.metrics.timeline), as /infer's Server-Timing: the
    # link, the batcher and the step (its compute among them) mark their parts here.
    marks = timeline.Timeline.starting_now()
    token = timeline.start(marks)
    try:
        decoded = await _rows(request, cfg, pool, output_dtype, optional=False)
        assert decoded is not None
        x, dtype, media, squeezed = decoded
        marks.mark(Part.DECODE)
        out, info = await gang.session_call(GangMethod.SESSION_APPEND, x, length, session_id=session_id,
                                            deadline=deadline, idempotency_key=key)
        marks.mark(Part.RETURN if marks.marks[-1][0] is Part.LINK_RECEIVE else Part.GANG)
        reply = _reply(out if squeezed else out[None], info, dtype, media, 200)
        marks.mark(Part.ENCODE)
    finally:
        timeline.reset(token)
    reply.headers["Server-Timing"] = marks.server_timing()
    return reply


@router.get("/sessions/{session_id}", summary="A session: length, weights version, created, last used, bytes held",
            openapi_extra=OPTIONAL_INFER_SECURITY, responses=INFER_ERROR_RESPONSES)
async def get_session(session_id: str, request: Request, cfg: AppConfig = Depends(get_config),
                      gang: Gang = Depends(get_gang)) -> JSONResponse:
    info = await gang.session_call(GangMethod.SESSION_INFO, session_id=session_id, deadline=_deadline(request, cfg))
    return JSONResponse(info, headers=_headers(info))


@router.delete("/sessions/{session_id}", summary="End a session (its cache blocks and kept inputs are freed)",
               openapi_extra=OPTIONAL_INFER_SECURITY, responses=INFER_ERROR_RESPONSES)
async def delete_session(session_id: str, request: Request, cfg: AppConfig = Depends(get_config),
                         gang: Gang = Depends(get_gang)) -> JSONResponse:
    info = await gang.session_call(GangMethod.SESSION_CLOSE, session_id=session_id, deadline=_deadline(request, cfg))
    return JSONResponse(info)


# ---------------------------------------------------------------- helpers

def _deadline(request: Request, cfg: AppConfig) -> float:
    return deadlines.request_deadline(time.monotonic(), cfg.serving.request_timeout_s,
                                      deadlines.header_timeout(request.headers.get(deadlines.HEADER)),
                                      tunables=cfg.tunables.ingress)


async def _rows(request: Request, cfg: AppConfig, pool: DecodePool, output_dtype: str | None,
                optional: bool) -> tuple[np.ndarray, np.dtype, str, bool] | None:
    """The body as rows [n, E] float32 (+ the reply dtype, media type, and whether it came as
    [n, E]: the reply has the request's shape); None for an empty body, or the JSON body `{}`,
    when `optional`."""
    if optional and not request.headers.get("content-type"):
        if not await read_body_capped(request, cfg.serving.max_json_bytes, "max_json_bytes"):
            return None  # no body at all: a session without a prefill
    media = codecs.media_type_of(request.headers.get("content-type"))
    reply_media = codecs.negotiate(request.headers.get("accept"), media)
    check_declared_length(request, cfg.serving.max_body_bytes)
    if media == codecs.JSON:
        body = await read_body_capped(request, cfg.serving.max_json_bytes, "max_json_bytes")
    else:
        body = await read_body_capped(request, cfg.serving.max_body_bytes)
    if optional and (not body or (media == codecs.JSON and _empty_object(body))):
        return None  # no body, or `{}`: a session without a prefill
    limits = codecs.Limits.of(cfg)
    x, mask, squeezed, dtype = await pool.decode(_prepare_rows, body, media, limits, output_dtype, reply_media,
                                                 inline=len(body) <= cfg.tunables.ingress.inline_decode_bytes)
    return session_rows(x, mask, squeezed), dtype, reply_media, squeezed


def _empty_object(body: bytes) -> bool:
    """The JSON body is `{}`, an object with nothing in it (JSON whitespace aside)."""
    return len(body) <= 64 and body.translate(None, b" \t\r\n") == b"{}"


def _prepare_rows(body: bytes, media: str, limits: codecs.Limits, output_dtype: str | None,
                  reply_media: str) -> tuple[np.ndarray, np.ndarray | None, bool, np.dtype]:
    """As /infer decodes (shape and dtype checked before any value is converted), keeping any
    attention_mask *as sent* (an all-ones mask is still a mask, and refused)."""
    array, raw_mask = codecs.decode_request(body, media, limits)
    dtype = codecs.reply_dtype(array.dtype, output_dtype, reply_media)
    x, squeezed = codecs.validate_hidden_states(
        array, embed_dim=limits.embed_dim, max_seq_len=limits.max_seq_len, max_tokens=limits.max_tokens)
    return x, raw_mask, squeezed, dtype


def session_rows(x: np.ndarray, mask: np.ndarray | None, squeezed: bool) -> np.ndarray:
    """x [1, n, E] (or [n, E] sent, squeezed) float32 -> rows [n, E]; 422 for a mask, a batch
    of several sequences, or no row."""
    if mask is not None:
        raise InvalidInput("a session append takes no attention_mask: its rows are all tokens, attending "
                           "causally to the session's history; send only hidden_states")
    if x.shape[0] != 1:
        raise InvalidInput(f"a session append takes rows [n, E] or [1, n, E]; got a batch of {x.shape[0]} "
                           f"sequences {list(x.shape)} (one session per request)")
    if x.shape[1] < 1:
        raise InvalidInput("a session append needs at least one row")
    return x[0]


def _headers(info: dict[str, Any]) -> dict[str, str]:
    headers = {"X-Session-Id": str(info.get("session_id", "")), "X-Session-Length": str(info.get("length", "")),
               "X-Weights-Version": str(info.get("weights_version", "")),
               "X-Recomputed-Tokens": str(info.get("recomputed_tokens_this_append", 0))}
    if info.get("replayed"):
        headers[keys.REPLAYED_HEADER] = "true"
    return headers


def _reply(out: np.ndarray, info: dict[str, Any], dtype: np.dtype, media: str, status: int) -> Response:
    content = _encode(out, dtype, media)
    if media == codecs.JSON and content.endswith(b"}"):
        top = {k: info.get(k) for k in ("session_id", "length", "weights_version")}  # the contract's keys
        content = content[:-1] + b"," + orjson.dumps(top)[1:-1] + b',"session":' + orjson.dumps(info) + b"}"
    return Response(content=content, media_type=media, status_code=status, headers=_headers(info))
