"""Which model the builder arguments name, as its torch half: a built-in kind
(service.models.registry.KINDS names each once, with its torch half's class), or a user's
factory by import path (`model=pkg.module:factory`, called as `factory(embed_dim=E,
**model_args)`, returning an implementation of service.parallel.model.ModelDef; docs/models.md).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Protocol

from service.models.registry import KINDS, describe
from service.parallel.model import ModelDef


class ModelArgs(Protocol):
    """What the registry reads of the builder arguments (service.config.builder_args.ModelConfig has
    these; a built-in kind reads its own: service.models.registry)."""

    kind: str  # the builder argument `model`: a built-in kind or pkg.module:factory
    embed_dim: int
    model_args: Mapping[str, Any]


def resolve(args: ModelArgs) -> ModelDef:
    """The ModelDef the builder arguments name: a built-in kind (service.models.registry), or
    `pkg.module:factory`, which is imported and called with the embed dim and `model_args` as
    keywords (`factory(embed_dim=E, **model_args)`)."""
    if args.kind in KINDS:
        return torch_half(args.kind).of(describe(args))
    return resolve_kind(args.kind, args.embed_dim, args.model_args)


def torch_half(kind: str) -> Any:
    """The ModelDef class of built-in `kind` (KINDS' `torch_half`), imported on first use."""
    return import_factory(KINDS[kind].torch_half)


def resolve_kind(kind: str, embed_dim: int, model_args: Mapping[str, Any]) -> ModelDef:
    """A user's model: `pkg.module:factory`, imported and called as `factory(embed_dim=E,
    **model_args)` and checked to return the ModelDef protocol."""
    if ":" not in kind:
        raise ValueError(f"model {kind!r} is neither a built-in kind ({', '.join(KINDS)}) "
                         "nor an import path 'pkg.module:factory'")
    factory = import_factory(kind)
    made = factory(embed_dim=embed_dim, **dict(model_args))
    for attr in ("params", "build", "dense_module", "dense_forward", "init_weights", "metadata", "check_world_size"):
        if not callable(getattr(made, attr, None)):
            raise TypeError(f"model {kind!r}: the factory returned {type(made).__name__}, which has no "
                            f"{attr}() (docs/models.md lists the ModelDef protocol)")
    if made.embed_dim != embed_dim:
        raise ValueError(f"model {kind!r}: the factory's embed_dim is {made.embed_dim}, the builder "
                         f"arguments say {embed_dim}")
    return made


def import_factory(path: str) -> Callable[..., ModelDef]:
    """`pkg.module:name` -> the object, or ValueError saying what could not be found."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"model {path!r}: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model {path!r}: {module_name} has no callable {attr!r}")
    return factory
