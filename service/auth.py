"""Bearer-token auth for mutating routes.

The token is `GANGSERVE_API_TOKEN`, else the one in `$GANGSERVE_STATE_DIR/api_token`
(created once, mode 0600, its location logged). Comparison is constant-time
(`hmac.compare_digest`). Failures are 401 `{"error", "code"}`.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path

from fastapi import Request

from service.errors import Unauthorized
from service.state import state_dir

TOKEN_ENV = "GANGSERVE_API_TOKEN"
TOKEN_FILE = "api_token"

log = logging.getLogger("gangserve.auth")


def load_api_token(state: Path | None = None) -> tuple[str, str]:
    """(token, where it came from). Creates the token file if neither source has one.

    Creation is race-free between processes (several ingress replicas may start at once):
    the token is written to a private temp file, then hard-linked into place, which fails
    if another process won; the winner's token is then read.
    """
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return env, f"environment variable {TOKEN_ENV}"
    path = (state or state_dir()) / TOKEN_FILE
    existing = _read(path)
    if existing:
        return existing, str(path)
    tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, path)
            log.warning("generated an API token in %s (mode 0600); send it as 'Authorization: Bearer <token>'", path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    token = _read(path)
    if not token:
        raise RuntimeError(f"API token file {path} is empty; delete it or set {TOKEN_ENV}")
    return token, str(path)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def token_matches(presented: str, expected: str) -> bool:
    """Constant-time comparison (no early exit on the first differing byte)."""
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


async def require_token(request: Request) -> None:
    """FastAPI dependency: 401 unless `Authorization: Bearer <the API token>`."""
    expected: str | None = getattr(request.app.state, "api_token", None)
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise Unauthorized(
            f"this route needs 'Authorization: Bearer <token>' (the token is ${TOKEN_ENV} or "
            f"$GANGSERVE_STATE_DIR/{TOKEN_FILE}); the request had "
            + ("no Authorization header" if not header else f"an Authorization header with scheme {scheme!r}"),
            code="missing_token",
        )
    if expected is None or not token_matches(presented.strip(), expected):
        raise Unauthorized("the bearer token is not the service's API token", code="invalid_token")
