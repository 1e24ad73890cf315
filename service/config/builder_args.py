"""Configuration: one pydantic model per concern, composed into the builder's arguments.

`AppConfig` is what `service.app:build_app` validates (unknown keys rejected): a tree of one
section per concern, `cfg.model` (ModelConfig), `cfg.gang`, `cfg.batching`, `cfg.transport`,
`cfg.serving`, `cfg.sessions`, `cfg.training` (the training quotas, which service.training.limits
checks jobs and datasets against) and `cfg.tunables`. The builder arguments stay flat, as every
config writes them; each is declared once, with its description, in the section it belongs to,
and a class takes the section it needs, never the whole tree, where it can.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.config.tunables import Tunables, TransportTunables
from service.models.llama import llama_architecture
from service.models.registry import KINDS, describe, is_built_in

FLOAT16_MAX = 65504.0  # float16's largest finite value
GIB = 1024**3


# The builder arguments only `model=transformer` reads (refused with another model).
TRANSFORMER_ARGS = ("num_layers", "ffn_dim", "activation", "norm_first", "layer_norm_eps")




class ModelConfig(BaseModel):
    """What the gang computes: a model of service.parallel.model (docs/models.md), tensor-parallel."""

    # `kind` is the builder argument `model` (its alias): `cfg.model.kind`, as a training job's
    # `model: {kind: ...}`; either name is accepted.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True)

    kind: str = Field(
        "attention", min_length=1, max_length=300, alias="model",
        description="`attention`: one nn.MultiheadAttention(E, H) layer; `transformer`: "
        "nn.TransformerEncoder of `num_layers` nn.TransformerEncoderLayer(E, H, ffn_dim, dropout=0, activation, "
        "batch_first=True, norm_first, layer_norm_eps); or `pkg.module:factory`, a user's model, called as "
        "`factory(embed_dim=E, **model_args)` and returning the model protocol (docs/models.md).",
    )
    embed_dim: int = Field(512, ge=1, le=65536, description="Model width E.")
    num_heads: int = Field(8, ge=1, le=1024, description="Attention heads H; E % H == 0.")
    num_layers: int = Field(2, ge=1, le=512, description="model=transformer: encoder layers.")
    ffn_dim: int = Field(2048, ge=1, le=1 << 20,
                         description="model=transformer: the MLP's hidden width; world_size must divide it.")
    activation: Literal["relu", "gelu"] = Field("relu", description="model=transformer: the MLP's activation.")
    norm_first: bool = Field(False, description="model=transformer: pre-norm (true) or post-norm (false) layers.")
    layer_norm_eps: float = Field(1e-5, gt=0, le=1.0, description="model=transformer: the LayerNorms' epsilon.")
    model_args: dict[str, Any] = Field(
        default_factory=dict,
        description="The model kind's own arguments: a user's model (`model=pkg.module:factory`): keyword "
        "arguments for its factory; `model=llama`: a LlamaConfig's fields (read from the checkpoint directory's "
        "config.json when not given); `model=transformer`: its fields, as an alternative to the flat arguments.",
    )
    init: Literal["seed", "random"] = Field(
        "seed",
        description="Weight init when no checkpoint is given: 'seed' = the original notes' "
        "deterministic W[i,j] = i*E + j + offset; 'random' = uniform(+-1/sqrt(E)) from `seed`. Models other "
        "than attention have no notes' weights: both draw their reproducible random init from `seed`.",
    )
    seed: int = Field(0, ge=0, description="Generator seed for init=random.")
    checkpoint: str | None = Field(
        None,
        description="Absolute path of a dense safetensors checkpoint (the model's format, docs/api.md: for "
        "transformer its torch module's own state_dict; for llama a Hugging Face save_pretrained directory, "
        "its architecture read from its config.json); overrides `init`. Each rank reads only its slice, so on multi-node clusters it must "
        "be on storage every node sees.",
    )

    causal: bool = Field(
        False,
        description="Default attention for requests that do not say (`?causal=true|false`, OIP "
        "`parameters.causal`): causal (query i attends keys j <= i) or bidirectional. A checkpoint "
        "that records `causal` in its metadata (training writes it) overrides this default.",
    )
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="dtype of the ranks' weights, activations and collectives. bfloat16 runs on CPU "
        "and CUDA, float16 on CUDA only (use_gpu=true). Replies keep the requested dtype; the "
        "tolerance per dtype: [api.md](api.md#compute-dtype).",
    )

    @model_validator(mode="before")
    @classmethod
    def _kind_arguments(cls, data: Any) -> Any:
        """A built-in kind's own arguments. model=transformer: `model_args` may hold its fields
        (`num_layers`, `embed_dim`, `num_heads`, `ffn_dim`, ...), the same as the flat builder
        arguments (one given both ways is refused). model=llama: its architecture
        (service.models.llama.llama_architecture: the checkpoint directory's config.json, a
        llama checkpoint file's metadata, or `model_args`, a LlamaConfig's fields) becomes
        `model_args`; the width E and heads H are its `hidden_size` and `num_attention_heads`
        (given as well, they must agree)."""
        kind = data.get("model", data.get("kind")) if isinstance(data, dict) else None
        if kind == "transformer" and data.get("model_args"):
            own = ("embed_dim", "num_heads", *TRANSFORMER_ARGS)
            unknown = sorted(set(data["model_args"]) - set(own))
            twice = sorted(set(data["model_args"]) & {k for k in own if k in data})
            if unknown or twice:
                raise ValueError(f"model=transformer model_args: {', '.join(unknown)} not its arguments ({', '.join(own)})"
                                 if unknown else f"model=transformer: {', '.join(twice)} given twice (flat and in model_args)")
            return {**{k: v for k, v in data.items() if k != "model_args"}, **data["model_args"]}
        if kind != "llama":
            return data
        arch = llama_architecture(data.get("checkpoint"), data.get("model_args") or {})
        for name, value in (("embed_dim", arch.hidden_size), ("num_heads", arch.num_heads)):
            if data.get(name) not in (None, value):
                raise ValueError(f"model=llama: {name}={data[name]}, but its architecture says {value} "
                                 "(leave it out: it is read from the architecture)")
        # The architecture travels as model_args from here on: a swap to a training job's file
        # (an artifact key) or a rollback keeps it without reading the directory again.
        return {**data, "embed_dim": arch.hidden_size, "num_heads": arch.num_heads, "model_args": arch.hf_config()}

    @model_validator(mode="after")
    def _check_model_args(self) -> "ModelConfig":
        """Arguments of one model are refused with another (a typo would otherwise be ignored)."""
        # Compared with the defaults, not `model_fields_set`: a copy made with model_copy keeps its values.
        if self.kind != "transformer":
            fields = type(self).model_fields
            stray = [name for name in TRANSFORMER_ARGS if getattr(self, name) != fields[name].default]
            if stray:
                raise ValueError(f"{', '.join(stray)} only apply to model=transformer; model is {self.kind!r}")
        if self.model_args and ":" not in self.kind and self.kind != "llama":
            raise ValueError(f"model_args only apply to a user's model (model=pkg.module:factory) or to model=llama "
                             f"without a checkpoint directory; model is {self.kind!r}")
        if not is_built_in(self.kind) and ":" not in self.kind:
            raise ValueError(f"model must be one of {', '.join(KINDS)} or an import path "
                             f"pkg.module:factory; got {self.kind!r}")
        return self

    @property
    def weights_source(self) -> str:
        if self.checkpoint:
            return f"checkpoint:{self.checkpoint}"
        return "seed" if self.init == "seed" else f"random:seed={self.seed}"


class GangConfig(BaseModel):
    """How the gang of rank processes is placed and bounded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    world_size: int = Field(2, ge=1, le=1024, description="Ranks in the gang; must divide num_heads.")
    use_gpu: bool = Field(False, description="Reserve one GPU per rank (one rank per GPU).")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto",
        description="Collective backend. auto = NCCL when every rank has a real CUDA device, "
        "else gloo (a rank holding a GPU resource without a CUDA device falls back to CPU).",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for the ranks' bundles."
    )
    num_replicas: int = Field(
        1, ge=1, le=1024,
        description="Gangs serving the app (data parallel x tensor parallel): GangServer replicas, "
        "each with its own placement group of world_size bundles. Exclusive with autoscaling_config.",
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Serve's autoscaling for the GangServer (min_replicas, max_replicas, "
        "target_ongoing_requests, ...): each replica is one gang. Exclusive with num_replicas.",
    )
    cpus_per_rank: float = Field(
        1.0, gt=0, le=256, description="Logical CPUs reserved per rank (fractions allowed)."
    )
    torch_threads_per_rank: int | None = Field(
        None, ge=1, le=256, description="torch intra-op threads per rank; default max(1, cpus_per_rank)."
    )
    allow_tf32: bool = Field(
        False,
        description="use_gpu: float32 matmuls in TF32 on the ranks' GPUs (Ampere and later: several times the "
        "throughput, about 1e-3 relative error instead of float32's 1e-7; "
        "[api.md](api.md#compute-dtype)). Only compute_dtype=float32 is affected; CPU ranks ignore it.",
    )
    schedule_timeout_s: float = Field(
        60.0, gt=0, le=86400, description="Longest wait for the cluster to place every rank."
    )
    stage_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="Bound on each bring-up stage (create, rendezvous, load)."
    )
    collective_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="How long one collective, or one step from its start, may take before "
        "the gang is declared broken (a rank is stuck) and rebuilt: the process groups' timeout and the step "
        "watchdog's bound; the rendezvous waits as long. Not a request's deadline (that is `request_timeout_s` "
        "or the request's own); a step stuck past it answers 504 `collective_timeout`, unless the request's own "
        "deadline passed first."
    )
    warm_spare: bool = Field(
        True,
        description="Keep one warm spare rank process per gang (started after bring-up, in a peer "
        "bundle, reserving no CPU of its own): a rebuild after a lost peer adopts it instead of "
        "starting a process and importing torch ([operations.md](operations.md#fast-rebuild-the-warm-spare)). CPU gangs only: a spare "
        "cannot hold a bundle's GPU, so use_gpu gangs always start a new process.",
    )
    @model_validator(mode="after")
    def _check_backend(self) -> "GangConfig":
        if self.backend == "nccl" and not self.use_gpu:
            raise ValueError("backend=nccl needs use_gpu=true (NCCL runs on CUDA devices only)")
        if self.autoscaling_config is not None:
            if self.num_replicas != 1:  # (1 is the default: a dumped-and-revalidated config carries it)
                raise ValueError("give num_replicas or autoscaling_config, not both")
            from ray.serve.config import AutoscalingConfig

            unknown = set(self.autoscaling_config) - set(AutoscalingConfig.model_fields)
            if unknown:
                raise ValueError(f"autoscaling_config: unknown keys {sorted(unknown)}; "
                                 f"valid: {sorted(AutoscalingConfig.model_fields)}")
            AutoscalingConfig.model_validate(self.autoscaling_config)  # Serve's own rules
        return self

    @property
    def min_gangs(self) -> int:
        """Gangs the cluster must be able to hold at once (num_replicas, or min_replicas >= 1)."""
        if self.autoscaling_config is None:
            return self.num_replicas
        return max(1, int(self.autoscaling_config.get("min_replicas", 1)))

    @property
    def single_gang(self) -> bool:
        """Exactly one gang, always (no autoscaling): nothing for a router to choose."""
        return self.autoscaling_config is None and self.num_replicas == 1

    @property
    def threads_per_rank(self) -> int:
        return self.torch_threads_per_rank or max(1, int(self.cpus_per_rank))


@dataclass(frozen=True)
class BatchPolicy:
    """How the batcher forms steps, in one place: the builder arguments max_batch_size,
    batch_wait_timeout_s and max_padding_fraction (BatchingConfig.policy builds it from
    them; service.gang.batching runs it), and the steps in flight at once."""

    max_batch_size: int  # most rows one step coalesces
    wait_s: float = 0.0  # extra wait for company when fewer rows are queued (0: none)
    max_padding_fraction: float = 0.0  # most padded share of a step's tokens (0: equal lengths only)
    max_in_flight: int = 1  # steps at once: 1 in front of the gang's sequencer


class BatchingConfig(BaseModel):
    """How a gang coalesces concurrent requests into steps (service.gang.batching)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(
        64, ge=1, le=65536,
        description="Most batch rows one gang step coalesces from concurrent requests (see max_padding_fraction).",
    )
    max_padding_fraction: float = Field(
        0.25, ge=0, lt=1,
        description="Mixed-length batching: requests of different seq lens share a step, padded to its "
        "longest with the key padding mask, while at most this share of the step's tokens is such "
        "padding. 0 = only requests of equal seq len share a step.",
    )
    batch_wait_timeout_s: float = Field(
        0.0, ge=0, le=1.0,
        description="Extra wait for company before a step when fewer than max_batch_size rows are queued; "
        "0 = none (batches still form from requests that arrive while a step runs). A stateless request "
        "that finds the gang idle never waits: the wait applies to requests queued behind a running step.",
    )

    @property
    def policy(self) -> BatchPolicy:
        """The batcher's policy: max_batch_size, batch_wait_timeout_s and max_padding_fraction."""
        return BatchPolicy(max_batch_size=self.max_batch_size, wait_s=self.batch_wait_timeout_s,
                           max_padding_fraction=self.max_padding_fraction)


class ServingConfig(BaseModel):
    """Request handling limits of the ingress and the gang server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Largest request body; larger gets 413 before it is read."
    )
    ingress_replicas: int = Field(
        1, ge=1, le=64,
        description="Replicas of the HTTP ingress (no logical CPU each), placed as ingress_placement "
        "says (2 in gpu.yaml and kuberay.yaml: one replica's process lost, the other answers).",
    )
    ingress_placement: Literal["head", "spread"] = Field(
        "head",
        description="Where the ingress replicas run. `head`: on the head node, beside the front door "
        "(HAProxy) that clients reach: a lost or cut-off worker node never holds an ingress replica, "
        "so HAProxy never falls back to Serve's Python proxy and never waits on a cut link for an "
        "answer; the ingress bounds its own call to the gang by the request's deadline. `spread`: "
        "at most ceil(replicas / alive nodes at deploy time) per node, for clusters whose clients "
        "use every node's front door (docs/operations.md#the-front-door-under-faults).",
    )
    max_json_bytes: int = Field(
        8 * 1024 * 1024, ge=1024,
        description="Largest JSON body (/infer JSON, an OIP request's JSON part), counted after "
        "gzip/deflate decompression; larger gets 413 (before it is read when Content-Length says so). "
        "Parsing JSON holds one core and the interpreter lock for ~5 ms per MiB; binary formats "
        "carry big tensors.",
    )
    decode_threads: int = Field(
        2, ge=1, le=64,
        description="Threads of the ingress's decoding pool: JSON parsing, decompression and large-body "
        "decoding run there, never on the event loop.",
    )
    max_pending_decodes: int = Field(
        64, ge=1, le=4096,
        description="Decodes admitted to the pool at once (running or waiting for a thread); one more "
        "gets 503 `overloaded` with Retry-After. Small binary bodies are decoded inline and never wait. "
        "The default is a gang's max_ongoing_requests: a request whose body has been read is not "
        "refused while its gang has room.",
    )
    max_seq_len: int = Field(4096, ge=1, description="Longest sequence accepted (attention is O(seq^2)).")
    max_tokens_per_request: int = Field(
        262144, ge=1, description="Largest batch * seq accepted in one request."
    )
    max_ongoing_requests: int = Field(
        64, ge=1, le=100000, description="Requests a gang server replica holds at once."
    )
    max_queued_requests: int = Field(
        256, ge=-1, description="Requests queued in front of the gang before 503 (-1: unbounded)."
    )
    request_timeout_s: float = Field(
        120.0, gt=0, description="The default deadline of an inference request (one without "
        "X-Request-Timeout-Seconds or OIP parameters.timeout): 504 `deadline_exceeded` after it; "
        "in-service retries and waits for a gang end there."
    )
    log_encoding: Literal["TEXT", "JSON"] | None = Field(
        None,
        description="Encoding of the Serve replicas' logs (the service's and Serve's own lines): TEXT, or "
        "JSON (one object per line, with request_id, route and application on request lines). None: "
        "Serve's default ($RAY_SERVE_LOG_ENCODING, else TEXT) or the config file's logging_config.",
    )
    same_event_loop: bool = Field(
        True,
        description="Run the ingress's and the gang server's code, and the ingress's handle router, on "
        "their replica's main event loop (Serve's RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 and "
        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0, set for those two deployments only): no thread hop "
        "between Serve and our code on every request (measured -2 to -3 ms per small request). Our "
        "request path never blocks its loop (heavy work runs in pools and the gang's sequencer).",
    )
    @model_validator(mode="after")
    def _check_json_limit(self) -> "ServingConfig":
        if self.max_json_bytes > self.max_body_bytes:
            raise ValueError(
                f"max_json_bytes ({self.max_json_bytes}) must not exceed max_body_bytes ({self.max_body_bytes})"
            )
        return self


class TransportConfig(BaseModel):
    """How request and reply tensors travel between the ingress and rank 0 (service.transport)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shm_transport: bool = Field(
        True,
        description="Hand request/reply tensors of tunables.transport.min_shared_bytes "
        f"({TransportTunables().min_shared_bytes // 1024} KiB by default) or more between the ingress and the "
        "GangServer through /dev/shm when both run on one node, instead of through Ray's object "
        "store; falls back to the object store otherwise (or when /dev/shm is missing or full).",
    )

    data_channel: bool = Field(
        True,
        description="Send requests from the ingress to rank 0 over a Unix socket instead of a Serve "
        "handle call when both run on one node and the app has one gang (fixed num_replicas: 1); "
        "saves the handle call's fixed cost (several ms). Status, weights and every other request "
        "keep using Serve handles; falls back to them whenever the socket cannot be used.",
    )


class SessionConfig(BaseModel):
    """Stateful sessions: each rank's KV cache for its heads, and the session limits (service.sessions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session_cache_bytes: int = Field(
        64 * 1024 * 1024, ge=0, le=1 << 40,
        description="KV cache budget per rank, bytes on the rank's device (CUDA memory on GPUs), allocated "
        "on the first session append: 2 * cached layers (1; transformer: num_layers) * (embed_dim / world_size) * "
        "dtype bytes per cached token, in "
        "blocks of session_block_tokens. When it is full, idle sessions are evicted (least recently used "
        "first) and recomputed from their kept inputs on their next append. 0 = sessions off.",
    )
    session_block_tokens: int = Field(
        16, ge=1, le=4096,
        description="Tokens per KV cache block (the paging unit: a session wastes at most one block's "
        "worth less one token). Larger blocks make the CPU decode kernel cheaper for grouped-query models "
        "(16 query heads over 4 K/V heads of 64 at 2048 cached tokens: 64 instead of 16 takes 0.8x the attention's "
        "time, 1 or 32 sessions a step) and change little for plain heads (benchmarks.md), at the cost of that "
        "waste: a cache then holds fewer short sessions. CUDA ranks in "
        "bfloat16/float16 read the pool in place (varlen_attn) only with pages of a multiple of 256 "
        "(FlashAttention's paged layout); with 16 they copy each session's K/V per step.",
    )
    max_sessions: int = Field(
        1024, ge=1, le=1_000_000,
        description="Open sessions per gang; one more gets 429 `too_many_sessions` with Retry-After. Each "
        "keeps its inputs in rank 0's host memory (seq * embed_dim * 4 bytes) for recompute.",
    )
    max_session_tokens: int = Field(
        4096, ge=1, le=1 << 24,
        description="Longest session (tokens); an append past it gets 422 `session_too_long`.",
    )
    session_idle_timeout_s: float = Field(
        600.0, gt=0, le=30 * 86400,
        description="A session unused this long is ended; its id then answers 404 `session_expired`.",
    )


class TrainingLimits(BaseModel):
    """Training quotas (builder arguments). Active = PENDING or RUNNING: a waiting job already
    holds its run actor and its placement group request, so it counts as much as a running one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_active_jobs: int = Field(
        8, ge=1, le=10_000,
        description="Training jobs PENDING or RUNNING at once; one more is 429 quota_exceeded.",
    )
    max_training_workers: int = Field(
        32, ge=1, le=100_000,
        description="Training workers (the sum of world_size) that active jobs hold together; a job "
        "alone asking for more is 422 over_limit, one that does not fit next to the others 429.",
    )
    max_training_gpus: int = Field(
        8, ge=0, le=100_000,
        description="GPUs (world_size of use_gpu jobs) that active jobs hold together; 0 forbids GPU "
        "training. Alone over it: 422 over_limit; next to the others: 429 quota_exceeded.",
    )
    max_runtime_s: float = Field(
        6 * 3600.0, gt=0, le=30 * 86_400,
        description="Wall-clock limit of one job, from submission (PENDING included) to its end, and "
        "the default of the spec's max_runtime_s (which may only be lower). A job past it is stopped "
        "and FAILS naming max_runtime_s.",
    )
    max_datasets: int = Field(
        64, ge=1, le=1_000_000, description="Uploaded datasets stored at once; one more is 429 quota_exceeded."
    )
    max_dataset_bytes: int = Field(
        4 * GIB, ge=1024,
        description="Bytes all stored datasets may take together (as stored: float32 safetensors). "
        "One dataset alone over it: 422 over_limit; not fitting next to the others: 429.",
    )


# The sections of AppConfig, in the order of the builder-argument reference: attribute, class, title.
_SECTIONS: tuple[tuple[str, type[BaseModel], str], ...] = (
    ("model", ModelConfig, "Model"), ("gang", GangConfig, "Gang"), ("batching", BatchingConfig, "Batching"),
    ("transport", TransportConfig, "Transport"), ("serving", ServingConfig, "Serving"),
    ("sessions", SessionConfig, "Sessions"), ("training", TrainingLimits, "Training quotas"),
)


def _builder_names(cls: type[BaseModel]) -> dict[str, str]:
    """A section's builder-argument names -> its field names (the same, but for an alias)."""
    return {field.alias or name: name for name, field in cls.model_fields.items()}


# Every flat builder argument -> (section, field); `tunables` is its own nested section.
BUILDER_ARGS: dict[str, tuple[str, str]] = {
    arg: (section, name) for section, cls, _ in _SECTIONS for arg, name in _builder_names(cls).items()
}


class AppConfig(BaseModel):
    """Every `build_app` argument, as one tree: a section per concern (`cfg.gang.world_size`).

    The builder arguments stay flat (`world_size=4`, a config's `args: {world_size: 4}`): each
    flat name belongs to exactly one section (BUILDER_ARGS) and is moved into it before
    validation. A section may also be given whole (`gang: {world_size: 4}`). Unknown keys are
    rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    gang: GangConfig = Field(default_factory=GangConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    sessions: SessionConfig = Field(default_factory=SessionConfig)
    training: TrainingLimits = Field(default_factory=TrainingLimits)
    tunables: Tunables = Field(
        default_factory=Tunables,
        description="The machinery's timing and sizing knobs, by section (gang, fleet, transport, ingress, "
        "training, state): see [tunables.md](tunables.md). A partial override keeps the other defaults, "
        "e.g. `tunables: {state: {s3_request_timeout_s: 120.0}}`; an unknown key is refused.",
    )

    @model_validator(mode="before")
    @classmethod
    def _nest_builder_args(cls, data: Any) -> Any:
        """Flat builder arguments -> their sections. A section given whole (a mapping, or the
        section's object) is merged with its flat arguments; the same argument twice is refused."""
        if not isinstance(data, dict):
            return data
        nested: dict[str, Any] = {}
        for key, value in data.items():
            # `model` is both a section and a builder argument (the model's kind): a string is the kind.
            if key in cls.model_fields and not (key == "model" and isinstance(value, str)):
                section, given = key, value.model_dump(by_alias=True) if isinstance(value, BaseModel) else value
            elif key in BUILDER_ARGS:
                section, given = BUILDER_ARGS[key][0], {key: value}
            else:
                nested[key] = value  # refused by extra="forbid", under its own name
                continue
            part = nested.get(section)
            if isinstance(part, dict) and isinstance(given, dict):
                clash = sorted(set(part) & set(given))
                if clash:
                    raise ValueError(f"{', '.join(clash)} given both flat and in the {section} section")
                part.update(given)
            elif part is not None:
                raise ValueError(f"the {section} section is given twice, once not as a mapping")
            else:
                nested[section] = dict(given) if isinstance(given, dict) else given  # never the caller's dict
        return nested

    def relations(self) -> list[tuple[str, str, float, str, float]]:
        """(why, smaller, its value, larger, its value): every ordering the code relies on, between
        tunables and between a tunable and a builder argument."""
        return [
            *self.tunables.orderings(),
            ("a draining ingress replica answers a request with the default deadline before Serve kills it",
             "request_timeout_s", self.serving.request_timeout_s, "tunables.ingress.drain_timeout_s",
             self.tunables.ingress.drain_timeout_s),
        ]

    @model_validator(mode="after")
    def _check_relations(self) -> "AppConfig":
        """The one check of relations across the settings: each broken one names both numbers."""
        problems = [f"{a_name} ({a:g}) must be below {b_name} ({b:g}): {why}"
                    for why, a_name, a, b_name, b in self.relations() if not a < b]
        if problems:
            raise ValueError("inconsistent settings: " + "; ".join(problems))
        return self

    @model_validator(mode="after")
    def _check_across_sections(self) -> "AppConfig":
        # A built-in kind's split (service.models.registry); a user's model checks its own at
        # deploy time (service.app.check_model: ModelDef.check_world_size).
        if is_built_in(self.model.kind):
            problems = describe(self.model).problems(self.gang.world_size)
            if problems:
                raise ValueError("; ".join(problems))
        return self._check_dtype_and_paths()

    def _check_dtype_and_paths(self) -> "AppConfig":
        model = self.model
        if model.compute_dtype == "float16" and not self.gang.use_gpu:
            raise ValueError(
                "compute_dtype=float16 needs use_gpu=true (float16 matmuls are CUDA-only here); "
                "on CPU use bfloat16 or float32"
            )
        # The notes' seed weights are 0..E^2-1 scaled, far beyond float16's range at E=512:
        # refused here at deploy time, rather than serving inf/NaN with a 200.
        if (model.compute_dtype == "float16" and model.checkpoint is None and model.init == "seed"
                and model.kind == "attention" and model.embed_dim ** 2 - 1 > FLOAT16_MAX):
            raise ValueError(
                f"compute_dtype=float16 cannot hold init=seed weights at embed_dim={model.embed_dim} (they reach "
                f"{model.embed_dim ** 2 - 1}; float16's largest finite value is {FLOAT16_MAX:g}): use bfloat16 or "
                "float32, init=random, or a checkpoint"
            )
        if model.checkpoint is not None and not os.path.isabs(model.checkpoint):
            raise ValueError(f"checkpoint must be an absolute path, got {model.checkpoint!r}")
        return self

    @property
    def uses_data_channel(self) -> bool:
        """Requests may reach rank 0 over the data channel (service.transport.channel): asked for, and
        one gang only (with several, Serve's router picks the gang)."""
        return self.transport.data_channel and self.gang.single_gang


# -- the builder-argument reference (docs/builder-arguments.md is generated from this) ------
def _default_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value >= 1024 * 1024 and value % (1024 * 1024) == 0:
        mib = value // (1024 * 1024)
        return f"{mib // 1024} GiB" if mib % 1024 == 0 else f"{mib} MiB"
    return str(value)


def builder_args_markdown() -> str:
    """The builder-argument reference as Markdown: one table per concern, each argument with
    its default and its field description (the text `AppConfig` validates against)."""
    lines = [
        "# Builder arguments",
        "",
        "Generated from `service/config/builder_args.py` (`make docs`; `tests/test_config.py` checks it is current).",
        "`service.app:build_app` validates these with `AppConfig`; unknown keys are rejected with the",
        "list of valid ones. The arguments are flat; each belongs to one section of the configuration",
        "tree (`world_size` is `cfg.gang.world_size`), which may also be given whole (`gang: {world_size: 4}`).",
        "Set them in a config's `args:` or on the command line:",
        "",
        "```bash",
        "serve run deployments/local.yaml",
        "serve run service.app:build_app world_size=4 cpus_per_rank=0.25 init=random seed=3",
        "```",
    ]
    for section, cls, title in _SECTIONS:
        lines += ["", f"## {title}", "", (cls.__doc__ or "").strip().splitlines()[0] + f" In the code: `cfg.{section}`.", "",
                  "| arg | default | meaning |", "|---|---|---|"]
        for arg, name in _builder_names(cls).items():
            field = cls.model_fields[name]
            text = " ".join((field.description or "").split()).replace("|", "\\|")
            lines.append(f"| `{arg}` | {_default_text(field.default)} | {text} |")
    text = " ".join((AppConfig.model_fields["tunables"].description or "").split())
    lines += ["", "## Tunables", "", "One optional nested section, validated by `service.config.tunables.Tunables`.", "",
              "| arg | default | meaning |", "|---|---|---|", f"| `tunables` | the defaults | {text} |"]
    lines += ["", "## Relations checked", "", "AppConfig's validator refuses arguments that break one, naming both values:", ""]
    lines += [f"- `{a}` < `{b}`: {why}" for why, a, _, b, _ in AppConfig().relations()]
    lines += ["", "## Environment", "", "Where state lives and the secrets are environment variables, not builder arguments:",
              "[environment.md](environment.md) lists every one the service reads."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m service.config.builder_args > docs/builder-arguments.md
    print(builder_args_markdown(), end="")
