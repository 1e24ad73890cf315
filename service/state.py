"""Where gangserve keeps its state: `GANGSERVE_STATE_DIR` (default `.gangserve/` in the cwd).

Job records (SQLite), uploaded datasets, training runs and checkpoints, and the generated
API token live here. On multi-node clusters it must be storage every node sees.
"""
from __future__ import annotations

import os
from pathlib import Path

STATE_DIR_ENV = "GANGSERVE_STATE_DIR"
DEFAULT_STATE_DIR = ".gangserve"


def state_dir() -> Path:
    """The absolute state directory, created (mode 0700) if missing.

    Resolved to an absolute path once here because Ray Train changes the working
    directory of its workers: a relative path would point somewhere else there.
    """
    path = Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def resolve_inside(root: Path, candidate: str | os.PathLike[str]) -> Path:
    """`candidate` (absolute, or relative to `root`) resolved; ValueError unless inside `root`.

    Symlinks are resolved first, so neither `..` nor a link can escape the state dir.
    """
    root = root.resolve()
    path = Path(candidate)
    path = (path if path.is_absolute() else root / path).resolve()
    if path != root and root not in path.parents:
        raise ValueError(f"path {str(candidate)!r} resolves to {path}, outside the state dir {root}")
    return path
