"""Shared OpenAPI pieces: the error body every route returns, and the statuses that carry it."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorBody(BaseModel):
    """Every error reply (OIP routes included: their clients read `error`)."""

    error: str = Field(description="What was needed and what was found.")
    code: str = Field(description="Stable machine code, e.g. malformed, invalid_input, gang_scheduling.")


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


# Statuses a tensor-carrying POST route can answer besides 200.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _err("malformed body or headers"),
    406: _err("Accept names no supported format"),
    413: _err("body over max_body_bytes (refused before it is read)"),
    415: _err("unsupported Content-Type or Content-Encoding"),
    422: _err("wrong shape, dtype, name, non-finite values, or over max_seq_len / max_tokens_per_request"),
    503: _err("gang not ready or overloaded; has Retry-After"),
    504: _err("the gang did not answer within the deadline"),
}
