"""Where gangserve keeps its state: `GANGSERVE_STATE_DIR` (default `.gangserve/` in the cwd).

Job records (SQLite), uploaded datasets, training runs and checkpoints, and the generated
API token live here. On multi-node clusters it must be storage every node sees. The
directory is created with mode 0700; an existing one that group or others can read is
used as it is, with a warning (logged once per process and directory).
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

STATE_DIR_ENV = "GANGSERVE_STATE_DIR"
DEFAULT_STATE_DIR = ".gangserve"

log = logging.getLogger("gangserve.state")
_checked: set[Path] = set()


def state_dir() -> Path:
    """The absolute state directory, created (mode 0700) if missing.

    Resolved to an absolute path once here because a Ray actor (a run actor, a rank actor)
    need not run in the driver's working directory: a relative path would point somewhere
    else there.
    """
    path = Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR).expanduser().resolve()
    try:
        path.mkdir(parents=True, mode=0o700)  # the umask can only narrow 0700
    except FileExistsError:
        if not path.is_dir():
            raise NotADirectoryError(f"{STATE_DIR_ENV}={path} exists and is not a directory") from None
        if path not in _checked:
            _checked.add(path)
            warn_if_exposed(path)
    return path


def warn_if_exposed(path: Path) -> bool:
    """Log a warning (and return True) when group or others have any access to `path`."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    if not mode & (stat.S_IRWXG | stat.S_IRWXO):
        return False
    log.warning(
        "state directory %s has mode %o: group/others can read the job records, datasets and checkpoints "
        "(and the API token file, if any) in it; chmod 700 it or set %s to a private directory",
        path, stat.S_IMODE(mode), STATE_DIR_ENV,
    )
    return True


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
