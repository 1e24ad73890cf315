"""Which model the builder arguments name: a built-in kind, or a user's factory by import path.

`model=attention` (service.parallel.attention), `model=transformer`
(service.parallel.transformer) and `model=llama` (service.parallel.llama: its architecture from
the checkpoint directory's config.json, or from `model_args`) are the built-in kinds; `model=pkg.module:factory` imports a
user's factory and calls it as `factory(embed_dim=E, **model_args)`; it returns an
implementation of service.parallel.model.ModelDef (docs/models.md).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Protocol

from service.parallel.attention import AttentionDef
from service.parallel.llama import LlamaDef
from service.models.llama import llama_architecture
from service.parallel.model import ModelDef
from service.parallel.transformer import TransformerDef


class ModelArgs(Protocol):
    """What the registry reads of the builder arguments (service.config.builder_args.ModelConfig has these)."""

    kind: str  # the builder argument `model`: a built-in kind or pkg.module:factory
    embed_dim: int
    num_heads: int
    num_layers: int
    ffn_dim: int
    activation: str
    norm_first: bool
    layer_norm_eps: float
    model_args: Mapping[str, Any]
    checkpoint: str | None


Factory = Callable[[ModelArgs], ModelDef]
_REGISTRY: dict[str, Factory] = {
    "attention": lambda a: AttentionDef(a.embed_dim, a.num_heads),
    "transformer": lambda a: TransformerDef(a.num_layers, a.embed_dim, a.num_heads, a.ffn_dim, a.activation,
                                            a.norm_first, a.layer_norm_eps),
    "llama": lambda a: LlamaDef(llama_architecture(a.checkpoint, a.model_args)),  # model_args once validated
}



def resolve(args: ModelArgs) -> ModelDef:
    """The ModelDef the builder arguments name: a registered kind (`attention`,
    `transformer`), or `pkg.module:factory`, which is imported and called with the
    embed dim and `model_args` as keywords (`factory(embed_dim=E, **model_args)`)."""
    if args.kind in _REGISTRY:
        return _REGISTRY[args.kind](args)
    return resolve_kind(args.kind, args.embed_dim, args.model_args)


def resolve_kind(kind: str, embed_dim: int, model_args: Mapping[str, Any]) -> ModelDef:
    """A kind named with its own arguments (a training job's model): `llama` (model_args a
    LlamaConfig's fields), or `pkg.module:factory`, imported and called as
    `factory(embed_dim=E, **model_args)` and checked to return the ModelDef protocol."""
    if kind == "llama":
        return LlamaDef(llama_architecture(None, model_args))
    if ":" not in kind:
        raise ValueError(f"model {kind!r} is neither a built-in kind ({', '.join(sorted(_REGISTRY))}) "
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
