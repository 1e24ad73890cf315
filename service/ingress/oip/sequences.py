"""OIP v2 sequences (Triton's names) on gangserve's sessions (service.sessions).

`parameters.sequence_id` (a non-zero integer or a non-empty string; 0 / "" / absent: a
stateless request), `sequence_start` and `sequence_end` (booleans) mean what they mean to
Triton's sequence batcher: `sequence_start` opens the sequence (409 `session_exists` if
it is live), every request appends its rows `[n, E]` / `[1, n, E]` and answers their
outputs (causal over the whole sequence), `sequence_end` ends it after this request. So a
stock `tritonclient.http` `infer(..., sequence_id=, sequence_start=, sequence_end=)`
drives a session. The id is the client's: it is namespaced (`oip:<id>`) apart from the ids
POST /sessions hands out, and with several gangs it is routed by rendezvous hashing
(service.gang.router). An `attention_mask` input or `parameters.causal` is refused (422).

`parameters.idempotency_key` is the request's idempotency key (service.sessions.keys: 1-128
visible ASCII characters, else 422 `invalid_request`), as HTTP's `Idempotency-Key` is for an
append: a retry with it gets the first answer and appends nothing (a retried
`sequence_start` whose first try opened the sequence too); without one the ingress makes one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from service.contract.errors import InvalidInput
from service.sessions import keys
from service.ingress.oip.schemas import MAX_ID_CHARS, InferenceRequest
from service.sessions.ids import OIP_PREFIX


@dataclass(frozen=True)
class Sequence:
    id: str  # the registry's id: OIP_PREFIX + the client's
    start: bool
    end: bool
    idempotency_key: str | None = None  # the client's (None: the ingress makes one)


def sequence_of(req: InferenceRequest) -> Sequence | None:
    """The request's sequence parameters, None for a stateless request; 422 when malformed."""
    params: dict[str, Any] = req.parameters or {}
    raw = params.get("sequence_id")
    if raw is None or raw == 0 or raw == "":
        for flag in ("sequence_start", "sequence_end"):
            if params.get(flag):
                raise InvalidInput(f"parameter {flag} needs a sequence_id (a non-zero integer or a non-empty string)")
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, str)) or (isinstance(raw, str) and len(raw) > MAX_ID_CHARS):
        raise InvalidInput(f"parameter sequence_id must be an integer or a string of at most {MAX_ID_CHARS} "
                           f"characters; got {raw!r:.50}")
    flags = {}
    for flag in ("sequence_start", "sequence_end"):
        value = params.get(flag, False)
        if not isinstance(value, bool):
            raise InvalidInput(f"parameter {flag} must be a boolean; got {value!r:.50}")
        flags[flag] = value
    if params.get("causal") is not None:
        raise InvalidInput("parameter causal does not apply to a sequence: its rows always attend causally to "
                           "the whole sequence")
    if any(i.name == "attention_mask" for i in req.inputs):
        raise InvalidInput("a sequence request takes no attention_mask input: its rows are all tokens")
    key = keys.key_of(params.get(keys.OIP_PARAMETER), f"parameter {keys.OIP_PARAMETER}")
    return Sequence(OIP_PREFIX + str(raw), flags["sequence_start"], flags["sequence_end"], key)


def rows_of(x: np.ndarray) -> np.ndarray:
    """x [1, n, E] float32 -> [n, E]; 422 for a batch of several sequences."""
    if x.shape[0] != 1 or x.shape[1] < 1:
        raise InvalidInput(f"a sequence request takes rows [n, E] or [1, n, E] with n >= 1; got {list(x.shape)}")
    return x[0]
