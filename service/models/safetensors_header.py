"""A safetensors file's header, read without torch: its metadata and tensor shapes.

safetensors' layout: 8 bytes little-endian N, then N bytes of JSON, {name: {"dtype", "shape",
"data_offsets"}, "__metadata__": {str: str}}. Processes that load no torch (the JobManager)
read checkpoints' architectures with it."""
from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

Shapes = dict[str, tuple[int, ...]]


def read_header(path: str | Path) -> tuple[dict[str, str], Shapes]:
    """(metadata, tensor shapes) of a local safetensors file, from its header only; both
    empty when the file is not safetensors."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if not 2 <= n <= MAX_HEADER_BYTES:
            return {}, {}
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return {}, {}
    if not isinstance(header, dict):
        return {}, {}
    meta = header.pop("__metadata__", None)
    meta = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
    shapes = {k: tuple(int(d) for d in v.get("shape", ())) for k, v in header.items() if isinstance(v, dict)}
    return meta, shapes
