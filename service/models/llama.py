"""`model=llama`'s architecture, torch-free: what a Hugging Face Llama-family `config.json` says.

Read by the builder arguments (the request width is `hidden_size`) in processes that load no
torch, and by the torch half (service.parallel.llama), which computes it. Both config.json
spellings of the rotary settings are read: transformers 5's `rope_parameters`
(`{"rope_type", "rope_theta", ...}`) and 4's `rope_theta` + `rope_scaling`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

from service.models.params import ParamSpec, Shard
from service.models.safetensors_header import read_header

CONFIG_FILE = "config.json"
ROPE_TYPES = ("default", "llama3")
ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class Llama3Rope:
    """The `llama3` rope scaling (Llama 3.1): low frequencies divided by `factor`, high ones
    kept, the band between interpolated (transformers' `_compute_llama3_parameters`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaArchitecture:
    """A Llama-family decoder stack (LlamaModel without `embed_tokens`): `num_layers` blocks of
    RMSNorm, rotary self-attention with `num_kv_heads` K/V heads (grouped-query when fewer than
    `num_heads`), RMSNorm and the SwiGLU MLP, then the final RMSNorm."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_llama3: Llama3Rope | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    kind: ClassVar[str] = "llama"

    @property
    def embed_dim(self) -> int:
        """E, the width of every request and reply row."""
        return self.hidden_size

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], where: str = "config") -> "LlamaArchitecture":
        """From a `LlamaConfig`'s dict (config.json); ValueError naming what is missing or unsupported."""
        def need(key: str) -> Any:
            if key not in config:
                raise ValueError(f"{where} has no {key!r}: a Llama-family config.json names it")
            return config[key]
        act = config.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (model=llama computes {ACTIVATIONS})")
        rope = dict(config.get("rope_parameters") or {})
        scaling = dict(config.get("rope_scaling") or {})
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{where}: rope type {rope_type!r} is not supported (model=llama computes {ROPE_TYPES})")
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        llama3 = None
        if rope_type == "llama3":
            p = {**scaling, **rope}
            try:
                llama3 = Llama3Rope(float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"]),
                                    int(p.get("original_max_position_embeddings") or need("max_position_embeddings")))
            except KeyError as exc:
                raise ValueError(f"{where}: rope type llama3 needs {exc.args[0]!r}") from None
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        return cls(hidden_size=hidden, num_layers=int(need("num_hidden_layers")), num_heads=heads,
                   num_kv_heads=int(config.get("num_key_value_heads") or heads),
                   intermediate_size=int(need("intermediate_size")),
                   head_dim=int(config.get("head_dim") or hidden // heads),
                   rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_llama3=llama3,
                   attention_bias=bool(config.get("attention_bias", False)),
                   mlp_bias=bool(config.get("mlp_bias", False)))

    @classmethod
    def read(cls, directory: str | Path) -> "LlamaArchitecture":
        """From `directory/config.json` (a `save_pretrained` directory); ValueError when unreadable."""
        path = Path(directory) / CONFIG_FILE
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"model=llama reads its architecture from {path}: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path} is not a JSON object")
        return cls.from_hf_config(config, where=str(path))

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str], where: str = "checkpoint metadata") -> "LlamaArchitecture":
        """Inverse of `metadata()`: the architecture a llama checkpoint file records (training writes it)."""
        try:
            rope = None
            if meta.get("rope_type", "default") == "llama3":
                rope = Llama3Rope(float(meta["rope_factor"]), float(meta["rope_low_freq_factor"]),
                                  float(meta["rope_high_freq_factor"]),
                                  int(meta["rope_original_max_position_embeddings"]))
            return cls(hidden_size=int(meta["hidden_size"]), num_layers=int(meta["num_hidden_layers"]),
                       num_heads=int(meta["num_attention_heads"]), num_kv_heads=int(meta["num_key_value_heads"]),
                       intermediate_size=int(meta["intermediate_size"]), head_dim=int(meta["head_dim"]),
                       rms_norm_eps=float(meta["rms_norm_eps"]), rope_theta=float(meta["rope_theta"]),
                       rope_llama3=rope, attention_bias=meta.get("attention_bias") == "true",
                       mlp_bias=meta.get("mlp_bias") == "true")
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{where} does not record a llama architecture ({type(exc).__name__}: {exc}); "
                             "a llama checkpoint file records what metadata() writes") from None

    def params(self) -> tuple[ParamSpec, ...]:
        """Every tensor of LlamaModel's state_dict but embed_tokens, in its order, and its sharding:
        q/k/v COLUMN by head (K/V replicated when fewer heads than ranks), o_proj and down_proj
        ROW, gate/up COLUMN, norms replicated."""
        a, P = self, ParamSpec
        col, row, rep = Shard.COLUMN, Shard.ROW, Shard.REPLICATED
        e, d, i = a.hidden_size, a.head_dim, a.intermediate_size
        specs: list[ParamSpec] = []
        for n in range(a.num_layers):
            at = f"layers.{n}."
            for proj, heads in (("q_proj", a.num_heads), ("k_proj", a.num_kv_heads), ("v_proj", a.num_kv_heads)):
                specs.append(P(f"{at}self_attn.{proj}.weight", (heads * d, e), col, groups=heads))
                if a.attention_bias:
                    specs.append(P(f"{at}self_attn.{proj}.bias", (heads * d,), col, groups=heads))
            specs.append(P(f"{at}self_attn.o_proj.weight", (e, a.num_heads * d), row))
            if a.attention_bias:
                specs.append(P(f"{at}self_attn.o_proj.bias", (e,), rep))
            for proj, shape, shard in (("gate_proj", (i, e), col), ("up_proj", (i, e), col),
                                       ("down_proj", (e, i), row)):
                specs.append(P(f"{at}mlp.{proj}.weight", shape, shard))
                if a.mlp_bias:
                    specs.append(P(f"{at}mlp.{proj}.bias", (shape[0],), col if shard is col else rep))
            specs += [P(f"{at}input_layernorm.weight", (e,), rep), P(f"{at}post_attention_layernorm.weight", (e,), rep)]
        specs.append(P("norm.weight", (e,), rep))
        return tuple(specs)

    def hf_config(self) -> dict[str, Any]:
        """The LlamaConfig fields that define it (`from_hf_config` reads them back to an equal
        architecture): what the builder arguments keep as model=llama's `model_args`."""
        rope: dict[str, Any] = {"rope_type": "llama3" if self.rope_llama3 else "default", "rope_theta": self.rope_theta}
        if self.rope_llama3 is not None:
            r = self.rope_llama3
            rope.update(factor=r.factor, low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                        original_max_position_embeddings=r.original_max_position_embeddings)
        return {"hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "intermediate_size": self.intermediate_size, "head_dim": self.head_dim,
                "rms_norm_eps": self.rms_norm_eps, "rope_parameters": rope, "hidden_act": "silu",
                "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias}

    def problems(self, world_size: int) -> list[str]:
        """Why this stack cannot be split `world_size` ways (empty: it can), each naming the numbers."""
        p, out = world_size, []
        if self.num_heads % self.num_kv_heads:
            out.append(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                       f"({self.num_kv_heads})")
        if self.num_heads % p:
            out.append(f"num_attention_heads ({self.num_heads}) must be divisible by world_size ({p}): each rank "
                       "computes num_attention_heads / world_size whole heads")
        if self.num_kv_heads % p and p % self.num_kv_heads:
            out.append(f"num_key_value_heads ({self.num_kv_heads}) and world_size ({p}): one must divide the other "
                       "(each rank holds num_key_value_heads / world_size K/V heads, or each K/V head is held by "
                       "world_size / num_key_value_heads ranks)")
        if self.intermediate_size % p:
            out.append(f"intermediate_size ({self.intermediate_size}) must be divisible by world_size ({p})")
        if self.head_dim % 2:
            out.append(f"head_dim ({self.head_dim}) must be even (rotary embeddings rotate pairs)")
        return out

    def metadata(self) -> dict[str, str]:
        """What a checkpoint of this stack records (safetensors metadata), checked on load."""
        meta = {"model": "llama", "hidden_size": str(self.hidden_size), "num_hidden_layers": str(self.num_layers),
                "num_attention_heads": str(self.num_heads), "num_key_value_heads": str(self.num_kv_heads),
                "intermediate_size": str(self.intermediate_size), "head_dim": str(self.head_dim),
                "rms_norm_eps": repr(self.rms_norm_eps), "rope_theta": repr(self.rope_theta),
                "rope_type": "llama3" if self.rope_llama3 else "default",
                "attention_bias": str(self.attention_bias).lower(), "mlp_bias": str(self.mlp_bias).lower()}
        if self.rope_llama3 is not None:
            r = self.rope_llama3
            meta.update({"rope_factor": repr(r.factor), "rope_low_freq_factor": repr(r.low_freq_factor),
                         "rope_high_freq_factor": repr(r.high_freq_factor),
                         "rope_original_max_position_embeddings": str(r.original_max_position_embeddings)})
        return meta


def llama_architecture(checkpoint: str | None, model_args: Mapping[str, Any]) -> LlamaArchitecture:
    """model=llama's architecture: `model_args` (a LlamaConfig's fields) when given; else the
    checkpoint's: a directory's config.json (a Hugging Face save_pretrained directory), or the
    metadata of a file that records one (a training job's checkpoint). With both a directory
    and `model_args`, they must agree. ValueError naming what is missing or differs."""
    is_dir = checkpoint is not None and os.path.isdir(checkpoint)
    if model_args:
        arch = LlamaArchitecture.from_hf_config(model_args, where="model_args")
        if is_dir and (read := LlamaArchitecture.read(checkpoint)) != arch:  # type: ignore[arg-type]
            raise ValueError(f"model=llama: model_args describe {arch}, but {checkpoint}/{CONFIG_FILE} describes "
                             f"{read}; leave model_args out (they are read from the directory)")
        return arch
    if is_dir:
        return LlamaArchitecture.read(checkpoint)  # type: ignore[arg-type]
    if checkpoint is not None and os.path.isfile(checkpoint):
        meta, _ = read_header(checkpoint)
        return LlamaArchitecture.from_metadata(meta, where=f"checkpoint {checkpoint}")
    raise ValueError("model=llama needs its architecture: checkpoint=DIR (a Hugging Face save_pretrained "
                     "directory with config.json), a llama checkpoint file, or model_args with a LlamaConfig's "
                     "fields (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
                     "intermediate_size, ...)")
