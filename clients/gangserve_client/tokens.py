"""Where the bearer tokens come from: the one rule, shared by the client and the service.

- The **API token** (training, datasets, weights; the full /gang): `$GANGSERVE_API_TOKEN`,
  else the file `$GANGSERVE_STATE_DIR/api_token` (state dir default `.gangserve`), which
  the service creates once (mode 0600) when neither exists. `service.ingress.auth` reads it with
  `api_token()` below, then creates the file if that found nothing.
- The optional **inference token** (`POST /infer`, OIP `.../infer`): `$GANGSERVE_INFER_TOKEN`.
  When the service has one, inference needs it or the API token.

Values are stripped of surrounding whitespace; an empty variable or file counts as unset.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

API_TOKEN_ENV = "GANGSERVE_API_TOKEN"
INFER_TOKEN_ENV = "GANGSERVE_INFER_TOKEN"
STATE_DIR_ENV = "GANGSERVE_STATE_DIR"
DEFAULT_STATE_DIR = ".gangserve"
TOKEN_FILE = "api_token"


def state_dir() -> Path:
    """`$GANGSERVE_STATE_DIR` or `.gangserve` (relative to the working directory); not created."""
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR).expanduser()


def token_file(state: Path | None = None) -> Path:
    return (state if state is not None else state_dir()) / TOKEN_FILE


def read_token_file(path: Path) -> str | None:
    """The token in `path`, or None when the file is missing or empty (other OSErrors propagate)."""
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


class FoundToken(NamedTuple):
    value: str
    source: str  # where it came from, for messages: the variable's name or the file's path
    file: Path | None  # the file it was read from; None when it came from the environment


def api_token(state: Path | Callable[[], Path] | None = None) -> FoundToken | None:
    """The API token by the rule above, or None when neither source has one.

    `state`: the state dir (default `state_dir()`), or a function returning it, called only
    when the environment has no token (the service's creates the directory).
    """
    env = os.environ.get(API_TOKEN_ENV, "").strip()
    if env:
        return FoundToken(env, f"environment variable {API_TOKEN_ENV}", None)
    path = token_file(state() if callable(state) else state)
    token = read_token_file(path)
    return FoundToken(token, str(path), path) if token else None


def infer_token() -> str | None:
    """`$GANGSERVE_INFER_TOKEN`, or None."""
    return os.environ.get(INFER_TOKEN_ENV, "").strip() or None
