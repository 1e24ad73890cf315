"""Node-local scratch named after the process that made it, so that any process on the node
can remove what a dead one left behind.

A scratch name carries its creator's pid (`<prefix><pid>-<rest>`). A process that dies
mid-write (SIGKILL, a lost node, an OOM kill) cannot clean up after itself; the next process
of the same kind sweeps every entry whose creator is gone. An entry of a live process is
never touched; a reused pid only keeps a leftover a while longer.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs on this node (also when another user owns it); a
    zombie, exited but not yet reaped by its parent, counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def sweep_dead_owners(directory: Path, name: re.Pattern[str]) -> int:
    """Remove every file or directory in `directory` whose name matches `name` (group 1: the
    creator's pid) and whose creator is gone; returns how many were removed. Never raises for
    an entry: one that cannot be removed (another sweeper was first, no permission) is
    skipped, so a cleanup never fails the work that calls it."""
    removed = 0
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return 0
    for path in entries:
        match = name.match(path.name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed += 1
        except OSError:
            continue
    return removed
