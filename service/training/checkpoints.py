"""A training checkpoint's file and the model it holds, read from its safetensors header:
no tensor is loaded and no torch imported (the JobManager checks `init_from` sources and
served checkpoints with it; tests/test_layout.py).

The model is an `Architecture` (service.weights.targets: the kind and its defining values
as its checkpoint metadata records them): attention {embed_dim, num_heads}, transformer
{num_layers, embed_dim, num_heads, ffn_dim, activation, norm_first, layer_norm_eps},
linear {in_features, out_features}; kind "unknown" when the file is none of them. Values a
file does not record (a checkpoint written without metadata) are None and fit any.

A built-in kind's architecture and the tensors its checkpoint holds (`expected_tensors`) are
its torch-free description's (service.models.registry: the same `params()` the ranks load by;
tests/test_models_training.py compares them with torch's own modules); a linear job's are
`weight`, `bias`; a user's model's tensors are known only to its factory (the run's strict
load checks them).
"""
from __future__ import annotations

import re
from pathlib import Path

from typing import Any, Mapping

from service.models.registry import describe, expected_tensors as kind_tensors, is_built_in
from service.models.safetensors_header import Shapes, read_header
from service.training.spec import AttentionModel, LinearModel, ModelSpecT, RegisteredModel, TransformerModel
from service.weights.targets import Architecture

MODEL_FILE = "model.safetensors"  # the model file's name inside an epoch checkpoint (runs/<job>/epoch-NNNNNN/)
_LAYER = re.compile(r"^layers\.(\d+)\.self_attn\.in_proj_weight$")


def checkpoint_architecture(metadata: dict[str, str] | None, tensors: Shapes) -> Architecture:
    """The model a checkpoint holds, from its safetensors header (metadata and tensor shapes):
    widths from the tensors, what tensors cannot say (heads, activation, ...) from the metadata."""
    meta = metadata or {}
    kind = meta.get("model", "")
    if kind == "llama" or ":" in kind:  # a registered kind records its architecture whole (ModelDef.metadata)
        return Architecture.of_metadata(kind, meta)
    if meta.get("model") == "transformer" or any(_LAYER.match(k) for k in tensors):
        layers = sorted(int(m.group(1)) for k in tensors if (m := _LAYER.match(k)))
        out_proj = tensors.get("layers.0.self_attn.out_proj.weight", ())
        linear1 = tensors.get("layers.0.linear1.weight", ())
        return Architecture.of(
            "transformer",
            num_layers=str(len(layers)) if layers else meta.get("num_layers"),
            embed_dim=str(out_proj[0]) if len(out_proj) == 2 else meta.get("embed_dim"),
            num_heads=meta.get("num_heads"),
            ffn_dim=str(linear1[0]) if len(linear1) == 2 else meta.get("ffn_dim"),
            activation=meta.get("activation"), norm_first=meta.get("norm_first"),
            layer_norm_eps=meta.get("layer_norm_eps"))
    if "out_proj.weight" in tensors and len(tensors["out_proj.weight"]) == 2:
        heads = meta.get("num_heads")
        return Architecture.of("attention", embed_dim=tensors["out_proj.weight"][0],
                               num_heads=heads if heads and heads.isdigit() else None)
    if set(tensors) == {"weight", "bias"} and len(tensors["weight"]) == 2:
        out_f, in_f = tensors["weight"]
        return Architecture.of("linear", in_features=in_f, out_features=out_f)
    return Architecture("unknown", (("tensors", str(sorted(tensors)[:8])),))


def read_architecture(path: Path) -> tuple[Architecture, Shapes]:
    """checkpoint_architecture of a local safetensors file (header only), and its tensor shapes."""
    meta, shapes = read_header(path)
    return checkpoint_architecture(meta, shapes), shapes


def spec_architecture(spec: ModelSpecT) -> Architecture:
    """A job's model in checkpoint_architecture's terms (`causal` is no part of it: it is the
    served default, not the weights' shape)."""
    if isinstance(spec, LinearModel):
        return Architecture.of("linear", in_features=spec.in_features, out_features=spec.out_features)
    if is_built_in(spec.kind):
        return Architecture.of_metadata(spec.kind, describe(spec).metadata())
    assert isinstance(spec, RegisteredModel)
    # A user's factory: E and its arguments, the names its ModelDef.metadata() should record
    # (a value it records under another name is not compared).
    return Architecture.of(spec.kind, embed_dim=spec.width,
                           **{k: v for k, v in spec.model_args.items() if k != "embed_dim"})


def expected_tensors(spec: ModelSpecT) -> Shapes | None:
    """The tensors (names and shapes, in checkpoint order) a checkpoint of `spec` holds; None
    for a user's model (its ModelDef's params() need its factory: the run's strict load checks them)."""
    if isinstance(spec, LinearModel):
        return {"weight": (spec.out_features, spec.in_features), "bias": (spec.out_features,)}
    if is_built_in(spec.kind):
        return kind_tensors(describe(spec))
    return None


def tensor_problems(spec: ModelSpecT, tensors: Shapes) -> list[str]:
    """Every tensor missing, unexpected or of another shape than `spec`'s checkpoint needs."""
    want = expected_tensors(spec)
    if want is None:
        return []
    problems = [f"missing {name!r} {list(shape)}" for name, shape in want.items() if name not in tensors]
    problems += [f"{name} has shape {list(tensors[name])}, the model needs {list(shape)}"
                 for name, shape in want.items() if name in tensors and tuple(tensors[name]) != shape]
    unexpected = sorted(set(tensors) - set(want))
    if unexpected:
        problems.append(f"unexpected {', '.join(repr(n) for n in unexpected[:10])}"
                        + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""))
    return problems


def fit_problems(spec: ModelSpecT, found: Architecture, tensors: Shapes) -> list[str]:
    """Why a checkpoint (its architecture and tensor shapes) cannot be loaded into `spec`'s
    model: its architecture's differences, else its tensors'; [] when it fits."""
    return found.differences(spec_architecture(spec)) or tensor_problems(spec, tensors)
