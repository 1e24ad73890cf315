"""The GPU machine's image, simulated in this process (see bench/gpu/image_sim.py).

Python imports `sitecustomize` at start-up from the first folder on sys.path that has one:
with this folder first on PYTHONPATH and GPU_IMAGE_SIM naming a simulation file, every module
that file lists (what the image lacks) raises ModuleNotFoundError on import, as it would on
the machine. Both variables are inherited, so the processes this one starts are blocked too.
Without GPU_IMAGE_SIM this file does nothing. Standard library only, and cheap: it runs in
every process of the check.

A file that cannot be read stops the process (exit 3, saying why): a simulation that silently
blocked nothing would let a broken check pass.
"""
from __future__ import annotations

import json
import os
import sys

_PATH = os.environ.get("GPU_IMAGE_SIM")


class _NotOnTheImage:
    """A meta-path finder placed first: refuses the listed modules and their submodules."""

    def __init__(self, blocked: list[str], why: str) -> None:
        self.blocked, self.why = frozenset(blocked), why

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        parts = fullname.split(".", 2)
        for name in (parts[0], ".".join(parts[:2])):
            if name in self.blocked:
                raise ModuleNotFoundError(f"No module named {name!r} ({self.why}; simulated by GPU_IMAGE_SIM)",
                                          name=name)
        return None


if _PATH:
    try:
        with open(_PATH) as f:
            _SIM = json.load(f)
        sys.meta_path.insert(0, _NotOnTheImage(_SIM["blocked"], _SIM["why"]))
    except (OSError, ValueError, KeyError) as exc:
        sys.stderr.write(f"GPU image simulation: cannot read GPU_IMAGE_SIM={_PATH}: {exc}\n")
        sys.stderr.flush()
        os._exit(3)
