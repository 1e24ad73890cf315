"""Bearer-token auth, checked at the ASGI level before any request body is read.

Two tokens:

- the **API token** (`GANGSERVE_API_TOKEN`, else the one in `$GANGSERVE_STATE_DIR/api_token`,
  created once with mode 0600 and its location logged) guards everything that is not
  inference: every method on `/train*`, `/datasets*` and `/weights*` (job specs, trained
  checkpoints, logs and datasets are read-protected too), and it unlocks the full `/gang`
  description (unauthenticated callers get it without file-system paths);
- the optional **inference token** (`GANGSERVE_INFER_TOKEN`): when set, `POST /infer`,
  the OIP `.../infer` routes and every `/sessions*` route need it (the API token is accepted there too).

`AuthMiddleware` enforces both on the raw ASGI scope, so a request without the right token
is answered 401 before the route, its dependencies or its body parsing run: an attacker's
body is never read. The route dependencies (`require_token`, `inference_auth`,
`optional_api_auth`) declare the schemes (`api_security`, `infer_security`: FastAPI's
`HTTPBearer`) so OpenAPI documents them; `require_token` also checks the token again.
Comparison is constant-time (`hmac.compare_digest`). Failures are 401 `{"error", "code"}`
with `WWW-Authenticate: Bearer`.
"""
from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette._utils import get_route_path
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gangserve_client import tokens
from service.contract.errors import ErrorCode, Unauthorized
from service.state.paths import state_dir

# Where the tokens come from is one rule, shared with the client: gangserve_client.tokens.
TOKEN_ENV = tokens.API_TOKEN_ENV
INFER_TOKEN_ENV = tokens.INFER_TOKEN_ENV
TOKEN_FILE = tokens.TOKEN_FILE

# Every method on these path prefixes needs the API token (segment-wise: /train, /train/..).
PROTECTED_PREFIXES = ("/train", "/datasets", "/weights")
# Inference routes: need the inference token when GANGSERVE_INFER_TOKEN is set.
INFER_PATH = re.compile(r"^/(infer|v2/models/[^/]+(/versions/[^/]+)?/infer|sessions(/[^/]+(/append)?)?)/?$")

log = logging.getLogger("gangserve.auth")

api_security = HTTPBearer(
    auto_error=False,
    scheme_name="APIToken",
    description=f"The API token: ${TOKEN_ENV}, or the token the service generated in "
    f"$GANGSERVE_STATE_DIR/{TOKEN_FILE}. Needed on /train*, /datasets*, /weights*.",
)
infer_security = HTTPBearer(
    auto_error=False,
    scheme_name="InferenceToken",
    description=f"Only when the service runs with ${INFER_TOKEN_ENV}: that token (or the API token). "
    "Without it, inference needs no token.",
)


# ---------------------------------------------------------------- tokens

def load_api_token(state: Path | None = None) -> tuple[str, str]:
    """(token, where it came from) by `gangserve_client.tokens.api_token`; creates the token
    file if neither the environment nor the file has one.

    Creation is race-free between processes (several ingress replicas may start at once):
    the token is written to a private temp file, then hard-linked into place, which fails
    if another process won; the winner's token is then read. An existing token file that
    group or others can read is used, with a warning.
    """
    found = tokens.api_token(state or state_dir)
    if found is not None:
        if found.file is not None:
            _warn_if_exposed(found.file)
        return found.value, found.source
    path = tokens.token_file(state or state_dir())
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
    token = tokens.read_token_file(path)
    if not token:
        raise RuntimeError(f"API token file {path} is empty; delete it or set {TOKEN_ENV}")
    return token, str(path)


def load_infer_token() -> str | None:
    """`GANGSERVE_INFER_TOKEN`, or None: inference then needs no token."""
    return tokens.infer_token()


def _warn_if_exposed(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("API token file %s has mode %o: group/others can read it; chmod 600 it", path, mode & 0o777)


def token_matches(presented: str, expected: str) -> bool:
    """Constant-time comparison (no early exit on the first differing byte)."""
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


def check_bearer(header: str | None, accepted: tuple[str, ...], what: str) -> Unauthorized | None:
    """None when `header` is `Bearer <one of accepted>`, else the 401 to answer."""
    scheme, _, presented = (header or "").partition(" ")
    presented = presented.strip()
    if scheme.lower() != "bearer" or not presented:
        found = "no Authorization header" if not header else f"an Authorization header with scheme {scheme[:20]!r}"
        return Unauthorized(f"this route needs 'Authorization: Bearer <{what}>'; the request had {found}",
                            code=ErrorCode.MISSING_TOKEN)
    # Every candidate is compared (no early exit), so timing does not tell which one matched.
    matched = [token_matches(presented, token) for token in accepted]
    if not any(matched):
        return Unauthorized(f"the bearer token is not the service's {what}", code=ErrorCode.INVALID_TOKEN)
    return None


def has_api_token(request: Request) -> bool:
    """Whether the request carries the API token (e.g. to show /gang in full)."""
    expected: str | None = getattr(request.app.state, "api_token", None)
    return expected is not None and check_bearer(request.headers.get("authorization"), (expected,), "API token") is None


# ---------------------------------------------------------------- route dependencies

async def require_token(
    request: Request, _: HTTPAuthorizationCredentials | None = Security(api_security)
) -> None:
    """FastAPI dependency: 401 unless `Authorization: Bearer <the API token>`.

    `AuthMiddleware` has already checked every protected path before the body was read;
    this declares the scheme in OpenAPI and guards a route mounted anywhere else.
    """
    expected: str | None = getattr(request.app.state, "api_token", None)
    error = check_bearer(request.headers.get("authorization"), (expected,) if expected else (), _API_TOKEN_WHAT)
    if error is not None:
        raise error


async def inference_auth(_: HTTPAuthorizationCredentials | None = Security(infer_security)) -> None:
    """Declares the optional inference scheme in OpenAPI; `AuthMiddleware` enforces it."""


async def optional_api_auth(_: HTTPAuthorizationCredentials | None = Security(api_security)) -> None:
    """Declares the API token as optional in OpenAPI (e.g. /gang: paths are shown only with it)."""


_API_TOKEN_WHAT = f"API token (${TOKEN_ENV} or $GANGSERVE_STATE_DIR/{TOKEN_FILE})"
_INFER_TOKEN_WHAT = f"inference token (${INFER_TOKEN_ENV})"


# ---------------------------------------------------------------- the ASGI check

def required_token(path: str) -> str | None:
    """'api', 'infer' or None: what the route at `path` (relative to the app's root) needs."""
    path = re.sub(r"/{2,}", "/", path) or "/"
    for prefix in PROTECTED_PREFIXES:
        if path == prefix or path.startswith(prefix + "/"):
            return "api"
    if INFER_PATH.match(path):
        return "infer"
    return None


class AuthMiddleware:
    """Pure ASGI middleware: the token check for a path runs before anything reads the body."""

    def __init__(self, app: ASGIApp, api_token: str, infer_token: str | None = None) -> None:
        self.app = app
        self.api_token = api_token
        self.infer_token = infer_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self.check(get_route_path(scope), Headers(scope=scope).get("authorization"))
            if error is not None:
                response = JSONResponse(
                    {"error": error.message, "code": error.code}, status_code=error.status,
                    headers={"WWW-Authenticate": 'Bearer realm="gangserve"'},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, path: str, header: str | None) -> Unauthorized | None:
        needed = required_token(path)
        if needed == "api":
            return check_bearer(header, (self.api_token,), _API_TOKEN_WHAT)
        if needed == "infer":
            return check_inference(header, self.infer_token, self.api_token)
        return None


def check_inference(header: str | None, infer_token: str | None, api_token: str) -> Unauthorized | None:
    """The inference calls' rule, HTTP's routes and gRPC's ModelInfer / ModelStreamInfer alike:
    None when no inference token is set, or when `header` (`Bearer <token>`) carries it or the
    API token; else the 401 to answer."""
    if infer_token is None:
        return None
    return check_bearer(header, (infer_token, api_token), _INFER_TOKEN_WHAT)


# ---------------------------------------------------------------- redaction

# A path: '/', '~/', './' or '../' then a non-'/' character, not right after a word character,
# '.', '/', '~' or '-' (so URLs' '//host/..', '10.0.0.0/8' and 'a/b' are left alone).
_PATH = re.compile(r"(?<![\w./~-])(?:~|\.{1,2})?/[^\s'\",;:()\[\]{}<>|/][^\s'\",;:()\[\]{}<>|]*")


def redact_paths(value: Any) -> Any:
    """`value` (a JSON-like tree) with every absolute or ./ ~/ path in its strings replaced
    by '<path>', for callers without the API token."""
    if isinstance(value, str):
        return _PATH.sub("<path>", value) if "/" in value else value
    if isinstance(value, dict):
        return {k: redact_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_paths(v) for v in value]
    return value
