"""The model kinds, each named once: its torch-free architecture and where its torch half lives.

A kind's architecture (`Architecture`) is built from the fields that name it, whether they come
from the builder arguments (service.config.builder_args.ModelConfig) or a training job's spec
(service.training.spec): `attention` from `embed_dim`, `num_heads`; `transformer` from those and
`num_layers`, `ffn_dim`, `activation`, `norm_first`, `layer_norm_eps`; `llama` from `model_args`
(a LlamaConfig's fields; the builder arguments read them from a checkpoint directory first).
Everything that needs a kind's parameters, checkpoint metadata or world-size rules asks here:
the builder arguments' checks, training's checkpoint checks, weights resolution and its 409s.
The torch half (service.parallel.registry.resolve) is the class `torch_half` names, built
from the same architecture with its `of(arch)`. A user's model (`pkg.module:factory`) is no
kind here: only importing it tells what it is, which the ranks and a job's run do.

Adding a kind: one torch-free module in service.models, one torch module in service.parallel,
one row in KINDS (docs/models.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

from service.models.attention import AttentionArch
from service.models.llama import LlamaArchitecture
from service.models.params import ParamSpec
from service.models.transformer import TransformerArch


class Architecture(Protocol):
    """A kind's torch-free description."""

    kind: str

    @property
    def embed_dim(self) -> int: ...

    def params(self) -> tuple[ParamSpec, ...]:
        """Every dense parameter, in checkpoint order, and how it is split over ranks."""
        ...

    def metadata(self) -> dict[str, str]:
        """What a checkpoint of it records (safetensors metadata), checked on load."""
        ...

    def problems(self, world_size: int) -> list[str]:
        """Why it cannot be split `world_size` ways (empty: it can), each naming the numbers."""
        ...


class KindFields(Protocol):
    """The fields a kind is built from (ModelConfig and the job specs have those of their kind)."""

    kind: str


@dataclass(frozen=True)
class Kind:
    name: str
    describe: Callable[[Any], Architecture]  # KindFields of this kind -> its architecture
    torch_half: str  # "module:Class", a ModelDef class with `of(arch)`


def _llama(fields: Any) -> LlamaArchitecture:
    model_args: Mapping[str, Any] = fields.model_args
    return LlamaArchitecture.from_hf_config(model_args, where="model_args")


KINDS: dict[str, Kind] = {
    "attention": Kind("attention", lambda f: AttentionArch(f.embed_dim, f.num_heads),
                      "service.parallel.attention:AttentionDef"),
    "transformer": Kind("transformer", lambda f: TransformerArch(f.num_layers, f.embed_dim, f.num_heads, f.ffn_dim,
                                                                 f.activation, f.norm_first, f.layer_norm_eps),
                        "service.parallel.transformer:TransformerDef"),
    "llama": Kind("llama", _llama, "service.parallel.llama:LlamaDef"),
}


def is_built_in(kind: str) -> bool:
    return kind in KINDS


def describe(fields: KindFields) -> Architecture:
    """The architecture of a built-in kind's fields; ValueError for another kind."""
    if fields.kind not in KINDS:
        raise ValueError(f"model {fields.kind!r} is not a built-in kind ({', '.join(KINDS)})")
    return KINDS[fields.kind].describe(fields)


def expected_tensors(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """The tensors (names and shapes, in checkpoint order) a checkpoint of `arch` holds."""
    return {spec.name: spec.shape for spec in arch.params()}
