"""A training checkpoint's file and the model it holds, read from its safetensors header:
no tensor is loaded and no torch imported (the JobManager checks `init_from` sources and
served checkpoints with it; tests/test_layout.py).

Shapes are plain dicts: {"kind": "attention", "embed_dim", "num_heads"} or {"kind":
"linear", "in_features", "out_features"}; {"kind": "unknown", "keys": [...]} otherwise.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from service.training.spec import AttentionModel, ModelSpecT

MODEL_FILE = "model.safetensors"  # the checkpoint file's name inside a Ray Train checkpoint
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def read_shape(path: Path) -> dict[str, Any]:
    """checkpoint_shape of a local safetensors file, from its header only."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if not 2 <= n <= MAX_HEADER_BYTES:
            return {"kind": "unknown", "keys": []}
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return {"kind": "unknown", "keys": []}
    meta = header.pop("__metadata__", None)
    shapes = {k: tuple(v.get("shape", ())) for k, v in header.items() if isinstance(v, dict)}
    return checkpoint_shape(meta, shapes)


def checkpoint_shape(metadata: dict[str, str] | None, tensors: dict[str, tuple[int, ...]]) -> dict[str, object]:
    """The model a checkpoint holds, from its safetensors header (metadata and tensor shapes):
    {"kind": "attention", "embed_dim", "num_heads"} or {"kind": "linear", "in_features",
    "out_features"}; {"kind": "unknown", "keys": [...]} when it is neither."""
    meta = metadata or {}
    if "out_proj.weight" in tensors and len(tensors["out_proj.weight"]) == 2:
        e = int(tensors["out_proj.weight"][0])
        heads = meta.get("num_heads")
        return {"kind": "attention", "embed_dim": e, "num_heads": int(heads) if heads and heads.isdigit() else None}
    if set(tensors) == {"weight", "bias"} and len(tensors["weight"]) == 2:
        out_f, in_f = tensors["weight"]
        return {"kind": "linear", "in_features": int(in_f), "out_features": int(out_f)}
    return {"kind": "unknown", "keys": sorted(tensors)[:8]}


def spec_shape(spec: ModelSpecT) -> dict[str, object]:
    """A model spec's shape in checkpoint_shape's terms."""
    if isinstance(spec, AttentionModel):
        return {"kind": "attention", "embed_dim": spec.embed_dim, "num_heads": spec.num_heads}
    return {"kind": "linear", "in_features": spec.in_features, "out_features": spec.out_features}


def describe_shape(shape: dict[str, object]) -> str:
    if shape["kind"] == "attention":
        return f"attention embed_dim {shape['embed_dim']}, num_heads {shape.get('num_heads') or '?'}"
    if shape["kind"] == "linear":
        return f"linear {shape['in_features']} -> {shape['out_features']}"
    return f"not a model checkpoint (tensors {shape.get('keys')})"
