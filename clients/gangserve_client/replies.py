"""What a 200 answer of /infer or a session call carries: the `output` tensor (`decode_reply`)
and the session's state in the headers (`session_info`). Shared by the client and its sessions."""
from __future__ import annotations

from typing import Any

import httpx
import numpy as np

from gangserve_client import codecs


def decode_reply(reply: httpx.Response) -> np.ndarray:
    """The `output` tensor of a 200 /infer reply, in the reply's dtype."""
    media = reply.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == codecs.SAFETENSORS:
        return codecs.decode_safetensors(reply.content, name=codecs.OUTPUT_NAME)
    if media == codecs.NPY:
        return codecs.decode_npy(reply.content)
    return codecs.decode_json(reply.content, name=codecs.OUTPUT_NAME)


def session_info(reply: httpx.Response, previous: dict[str, Any]) -> dict[str, Any]:
    """The session's state from an append's headers (every format carries them)."""
    h = reply.headers
    info = dict(previous)
    for key, header in (("length", "x-session-length"), ("weights_version", "x-weights-version")):
        if h.get(header, "").isdigit():
            info[key] = int(h[header])
    if h.get("x-session-id"):
        info["session_id"] = h["x-session-id"]
    info["replayed"] = h.get("idempotent-replayed", "").lower() == "true"  # a retry's remembered answer
    return info
