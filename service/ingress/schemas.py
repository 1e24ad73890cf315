"""Shared OpenAPI pieces: the error body every route returns, and the statuses that carry it."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorBody(BaseModel):
    """Every error reply (OIP routes included: their clients read `error`)."""

    error: str = Field(description="What was needed and what was found.")
    code: str = Field(description="Stable machine code, e.g. malformed, invalid_input, gang_scheduling.")


def inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its local `#/$defs/X` references replaced by their
    definitions (the OpenAPI document has no `$defs` at its root, so such a reference
    would dangle there). The models are not recursive, so this terminates."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {k: walk(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


# Statuses a tensor-carrying POST route can answer besides 200.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _err("malformed body or headers"),
    406: _err("Accept names no supported format"),
    413: _err("body over max_body_bytes, or a JSON body over max_json_bytes (refused before it is read "
              "when Content-Length says so; compressed bodies are inflated only up to the cap)"),
    415: _err("unsupported Content-Type or Content-Encoding"),
    422: _err("wrong shape, dtype, name, non-finite values, or over max_seq_len / max_tokens_per_request"),
    503: _err("gang not ready, or overloaded (code `overloaded`: too many bodies being decoded); has Retry-After"),
    504: _err("the gang did not answer within the deadline"),
}
# The inference routes add 401: only when the service runs with GANGSERVE_INFER_TOKEN.
INFER_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    401: _err("missing or wrong inference token (only when GANGSERVE_INFER_TOKEN is set)"),
}
# Routes that need the API token (auth.AuthMiddleware answers before the body is read).
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {401: _err("missing or wrong API token (code missing_token / invalid_token)")}
# OpenAPI: the inference scheme is optional (`{}` = no security needed), appended by FastAPI
# to the operation's `security` list (which the `inference_auth` dependency declares).
OPTIONAL_INFER_SECURITY: dict[str, Any] = {"security": [{}]}
