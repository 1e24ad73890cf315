"""Idempotency keys of session appends: their wire names, their rule, and the digest of rows.

Every append carries a key (issue 52): HTTP's `Idempotency-Key` header (the IETF draft's
name), OIP's `idempotency_key` request parameter. A client should send one, made fresh per
logical append and reused on every retry of it (gangserve_client does); the ingress makes one
(`new_key`) for an append that came without, before it chooses a route, so its own fallback
(service.transport.link) and retries (service.ingress.retries: an append is retried only
with a key) send the same key. The gang server's registry remembers a session's recent keys with their answers
(service.sessions.registry): an append retried with a remembered key gets the first answer
and appends nothing.

A key is 1 to MAX_KEY_CHARS visible ASCII characters (`!` .. `~`: no space, no control
character); the IETF draft's quoted form (`"..."`, a structured-field string) is taken without
its quotes. Anything else is 422 `invalid_request` (`key_of`), before anything is sent to the
gang.

Its own module, without torch or the registry: the ingress reads it (tests/test_layout.py).
"""
from __future__ import annotations

import hashlib
import re
import uuid

import numpy as np

from service.contract.errors import ErrorCode, InvalidInput

HEADER = "Idempotency-Key"  # HTTP (the IETF draft's name)
OIP_PARAMETER = "idempotency_key"  # the OIP v2 request parameter
REPLAYED_HEADER = "Idempotent-Replayed"  # "true" on an answer that was remembered, not computed again
MAX_KEY_CHARS = 128
_KEY = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_CHARS}}}")


def new_key() -> str:
    """A fresh key (a uuid4's 32 hex digits): what the ingress gives an append that came without one."""
    return uuid.uuid4().hex


def key_of(raw: object, where: str) -> str | None:
    """The key a client sent (`where`: the header's or parameter's name, for the message), or
    None when it sent none; 422 `invalid_request` when it is not a key."""
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise InvalidInput(f"{where} must be a string of 1-{MAX_KEY_CHARS} visible ASCII characters; got "
                           f"{type(raw).__name__} {raw!r:.50}", code=ErrorCode.INVALID_REQUEST)
    key = raw[1:-1] if len(raw) >= 2 and raw[0] == raw[-1] == '"' else raw  # the draft's sf-string form
    if _KEY.fullmatch(key) is None:
        why = ("empty" if not key else f"{len(key)} characters long" if len(key) > MAX_KEY_CHARS
               else "has a character outside visible ASCII ('!' .. '~')")
        raise InvalidInput(f"{where} must be 1-{MAX_KEY_CHARS} visible ASCII characters ('!' .. '~', e.g. a "
                           f"uuid4); the one sent is {why}: {raw!r:.60}", code=ErrorCode.INVALID_REQUEST)
    return key


def rows_digest(x: np.ndarray) -> bytes:
    """SHA-256 over the rows' dtype, shape and bytes (C order): what tells a retry (the same
    rows) from a reuse of its key for other rows."""
    h = hashlib.sha256()
    h.update(f"{x.dtype.str}{tuple(int(d) for d in x.shape)}".encode())
    h.update(memoryview(np.ascontiguousarray(x)).cast("B"))
    return h.digest()
