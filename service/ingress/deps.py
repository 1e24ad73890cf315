"""FastAPI dependencies: the gang client, the config, and a size-capped body reader."""
from __future__ import annotations

from fastapi import Request

from service.config import AppConfig
from service.errors import BadRequest, PayloadTooLarge
from service.ingress.gang_client import GangClient


def get_config(request: Request) -> AppConfig:
    return request.app.state.config


def get_gang(request: Request) -> GangClient:
    return request.app.state.gang


async def read_body_capped(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) as soon as it is known to exceed max_bytes.

    A declared Content-Length above the cap is refused before any byte is read; a
    chunked body is refused as soon as the running total passes the cap.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise BadRequest(f"Content-Length {declared!r} is not an integer") from None
        if length > max_bytes:
            raise PayloadTooLarge(f"body is {length} bytes; the limit is max_body_bytes={max_bytes}")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise PayloadTooLarge(f"body exceeds max_body_bytes={max_bytes}")
        chunks.append(chunk)
    return b"".join(chunks)
