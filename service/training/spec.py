"""The training job spec: one closed pydantic schema (unknown fields rejected, every number
bounded, defaults for everything so `{}` is a valid small job)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from service.models.llama import LlamaArchitecture
from service.models.params import parameter_count
from service.models.registry import describe

# Upper bound on the elements of one synthetic tensor (inputs or targets): 64 Mi float32
# = 256 MiB, generated in every worker.
MAX_SYNTHETIC_ELEMENTS = 64 * 1024 * 1024
# Upper bound on a transformer's parameters: the widest attention model's (E = 8192:
# 4 E^2 + 4 E), 1 GiB of float32 per copy (the model, its gradients, Adam's two moments).
MAX_MODEL_PARAMETERS = 4 * 8192 * 8192 + 4 * 8192


def _kind(value: object, default: str) -> str | None:
    """The union tag: `kind`, defaulting when omitted (so {"samples": 64} is a synthetic dataset).
    An unknown kind returns itself and pydantic reports the valid tags."""
    if isinstance(value, dict):
        kind = value.get("kind", default)
        return kind if isinstance(kind, str) else None
    return getattr(value, "kind", default)


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Heads(_Closed):
    """Width and heads of an attention model, and its causal default (both kinds below)."""

    embed_dim: int = Field(512, ge=8, le=8192, description="Model width E.")
    num_heads: int = Field(8, ge=1, le=256, description="Heads H; E % H == 0.")
    causal: bool = Field(
        False,
        description="Causal self-attention (query i attends keys j <= i; every layer of a stack). Recorded in "
        "the checkpoint's metadata, so the served model answers causally unless a request says otherwise.",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> "_Heads":
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})"
            )
        return self


class AttentionModel(_Heads):
    """Dense self-attention, nn.MultiheadAttention(E, H, bias=True, batch_first=True).

    Its checkpoint is the serving contract's dense format, so the gang can load it.
    """

    kind: Literal["attention"] = "attention"


class TransformerModel(_Heads):
    """torch's encoder stack, nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, ffn_dim,
    dropout=0, activation, batch_first=True, norm_first, layer_norm_eps), num_layers): what a gang
    of `model=transformer` serves (service.parallel.transformer). The defaults are the serving
    defaults, so `{"kind": "transformer"}` fits a default transformer app.

    Its checkpoint is that module's own `state_dict()` with the architecture's metadata, so
    it loads into torch's module with `strict=True` and into a gang of the same architecture.
    """

    kind: Literal["transformer"] = "transformer"
    num_layers: int = Field(2, ge=1, le=64, description="Encoder layers.")
    ffn_dim: int = Field(2048, ge=1, le=65536, description="The MLP's hidden width.")
    activation: Literal["relu", "gelu"] = Field("relu", description="The MLP's activation.")
    norm_first: bool = Field(False, description="Pre-norm (true) or post-norm (false) layers.")
    layer_norm_eps: float = Field(1e-5, gt=0, le=1.0, description="The LayerNorms' epsilon.")

    @model_validator(mode="after")
    def _not_too_large(self) -> "TransformerModel":
        count = parameter_count(describe(self).params())
        if count > MAX_MODEL_PARAMETERS:
            raise ValueError(
                f"transformer too large: {count} parameters ({self.num_layers} layers x "
                f"(4 x embed_dim {self.embed_dim}^2 + 2 x embed_dim x ffn_dim {self.ffn_dim} + biases and "
                f"norms)), the limit is {MAX_MODEL_PARAMETERS} (the widest attention model's)"
            )
        return self


class LinearModel(_Closed):
    """nn.Linear(in_features, out_features): the original notes' DDP example."""

    kind: Literal["linear"] = "linear"
    in_features: int = Field(10, ge=1, le=65536)
    out_features: int = Field(1, ge=1, le=65536)


# A registered kind other than the closed ones above: `llama`, or a user's factory by import path.
REGISTERED_KIND = r"^(llama|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$"


class RegisteredModel(_Closed):
    """Any model the gang serves by kind (service.parallel.registry): `llama` (its `model_args`
    a LlamaConfig's fields: hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, intermediate_size, ...), or a user's factory `pkg.module:factory`,
    called as `factory(embed_dim=E, **model_args)` in the run's workers (docs/models.md).

    A job trains that kind's dense module (ModelDef.dense_module, under its dense_forward) with
    DDP; its checkpoint is the module's own `state_dict()` with the kind's metadata, which a
    gang of the same architecture loads (`POST /weights {"job_id"}`). A user's factory is
    imported by the run, not at submit: one that does not import or build fails the job,
    naming why."""

    kind: str = Field(..., pattern=REGISTERED_KIND, max_length=300)
    embed_dim: int | None = Field(None, ge=1, le=8192,
                                  description="Model width E (a user's factory; llama reads hidden_size).")
    model_args: dict[str, Any] = Field(default_factory=dict, description="The kind's own arguments.")
    causal: bool = Field(False, description="Causal attention (a model that declares itself causal always is).")

    @model_validator(mode="after")
    def _architecture(self) -> "RegisteredModel":
        if self.kind == "llama":
            arch = LlamaArchitecture.from_hf_config(self.model_args, where="model.model_args")
            if self.embed_dim not in (None, arch.hidden_size):
                raise ValueError(f"model llama: embed_dim={self.embed_dim}, but model_args' hidden_size is "
                                 f"{arch.hidden_size} (leave embed_dim out)")
            if (count := parameter_count(arch.params())) > MAX_MODEL_PARAMETERS:
                raise ValueError(f"llama too large: {count} parameters, the limit is {MAX_MODEL_PARAMETERS} "
                                 "(the widest attention model's)")
        elif self.embed_dim is None:
            raise ValueError(f"model {self.kind}: embed_dim is required (the factory is called with it)")
        return self

    @property
    def width(self) -> int:
        """E: the width of every input and output row."""
        if self.kind == "llama":
            return LlamaArchitecture.from_hf_config(self.model_args).hidden_size
        assert self.embed_dim is not None
        return self.embed_dim


def _model_tag(value: object) -> str | None:
    kind = _kind(value, "attention")
    return "registered" if kind is not None and (kind == "llama" or ":" in kind) else kind


TrainingModel = Annotated[
    Union[Annotated[AttentionModel, Tag("attention")], Annotated[TransformerModel, Tag("transformer")],
          Annotated[LinearModel, Tag("linear")], Annotated[RegisteredModel, Tag("registered")]],
    Discriminator(_model_tag),
]
# a validated model spec (TrainingModel parses it: the kind picks the class)
ModelSpecT = AttentionModel | TransformerModel | LinearModel | RegisteredModel


class SyntheticDataset(_Closed):
    """Learnable synthetic data: inputs ~ N(0, 1); targets = a fixed random teacher of the
    same model kind applied to them, plus `noise` * N(0, 1)."""

    kind: Literal["synthetic"] = "synthetic"
    samples: int = Field(1024, ge=1, le=1_000_000)
    seq_len: int = Field(8, ge=1, le=4096, description="Sequence length (attention and transformer).")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds the inputs, the teacher and the noise.")
    noise: float = Field(0.01, ge=0, le=10, description="Std of the noise added to the targets.")
    validation_fraction: float = Field(
        0.1, ge=0, lt=1,
        description="Share of the samples held out for validation (the last floor(samples * fraction)): "
        "never trained on, their loss is each epoch's eval_loss. 0: no validation.",
    )


class UploadedDataset(_Closed):
    """A dataset uploaded with POST /datasets."""

    kind: Literal["uploaded"] = "uploaded"
    id: str = Field(..., pattern=r"^ds-[0-9a-f]{12}$", description="Id returned by POST /datasets.")
    validation_fraction: float | None = Field(
        None, ge=0, lt=1,
        description="Share of the samples held out for validation (the last floor(N * fraction)). "
        "Default: the dataset's own val_inputs/val_targets if it has them, else no validation. "
        "A dataset with its own validation tensors refuses a fraction > 0.",
    )


DatasetSpec = Annotated[
    Union[Annotated[SyntheticDataset, Tag("synthetic")], Annotated[UploadedDataset, Tag("uploaded")]],
    Discriminator(lambda v: _kind(v, "synthetic")),
]


class InitFrom(_Closed):
    """Where a job's initial weights come from: exactly one of a recorded served weights
    version (`"current"`: the one in force, resolved to its number at submit) or a
    SUCCEEDED job's final checkpoint. The shapes must equal the job's model."""

    weights_version: Annotated[int, Field(ge=1)] | Literal["current"] | None = Field(
        None, description='A recorded served weights version of this app (see GET /weights), or "current".')
    job_id: str | None = Field(None, pattern=r"^job-[0-9a-z]{1,64}$", description="A SUCCEEDED job of the same model shape.")

    @model_validator(mode="after")
    def _exactly_one(self) -> "InitFrom":
        if (self.weights_version is None) == (self.job_id is None):
            raise ValueError("init_from needs exactly one of weights_version or job_id")
        return self


class JobSpec(_Closed):
    """POST /train body. `batch_size` is per worker (each DDP rank steps on its own batch)."""

    model: TrainingModel = Field(default_factory=AttentionModel)
    dataset: DatasetSpec = Field(default_factory=SyntheticDataset)
    init_from: InitFrom | None = Field(
        None, description="Start from these weights instead of a random model (fine-tuning); absent: fresh.")
    world_size: int = Field(2, ge=1, le=256, description="DDP workers: one rank actor each, one placement group bundle each.")
    use_gpu: bool = Field(False, description="One GPU per worker (NCCL); else CPU with gloo.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "PACK",
        description="How the worker group's placement group places the workers: PACK (few nodes), SPREAD (many nodes, best "
        "effort) or STRICT_SPREAD (one worker per node; refused at once if the cluster has fewer nodes "
        "that can hold a worker).",
    )
    cpus_per_worker: float = Field(
        0.5, gt=0, le=256,
        description="Logical CPUs reserved per worker (fractions allowed, so a job fits next "
        "to the serving gang on a small machine).",
    )
    epochs: int = Field(5, ge=1, le=10_000)
    batch_size: int = Field(32, ge=1, le=65_536)
    lr: float = Field(0.01, gt=0, le=10)
    optimizer: Literal["sgd", "adam"] = "sgd"
    max_failures: int = Field(1, ge=0, le=100, description="Worker-group restarts (from the last checkpoint).")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds the student's initial weights and shuffling.")
    schedule_timeout_s: float = Field(
        300, ge=1, le=86_400,
        description="Longest a job may stay PENDING (cluster busy) before it FAILS with what it waited for.",
    )
    max_runtime_s: float | None = Field(
        None, gt=0, le=30 * 86_400,
        description="Wall-clock limit from submission (PENDING included) to the end; a job past it is "
        "stopped and FAILS. Default, and upper bound: the service's max_runtime_s.",
    )

    @model_validator(mode="after")
    def _bounded_data(self) -> "JobSpec":
        ds = self.dataset
        if isinstance(ds, SyntheticDataset):
            if isinstance(self.model, (AttentionModel, TransformerModel)):
                elements = ds.samples * ds.seq_len * self.model.embed_dim
            elif isinstance(self.model, RegisteredModel):
                elements = ds.samples * ds.seq_len * self.model.width
            else:
                elements = ds.samples * max(self.model.in_features, self.model.out_features)
            if elements > MAX_SYNTHETIC_ELEMENTS:
                raise ValueError(
                    f"synthetic dataset too large: {elements} elements per tensor, the limit is "
                    f"{MAX_SYNTHETIC_ELEMENTS} (reduce samples, seq_len or the model width)"
                )
        return self

    def worker_bundle(self) -> dict[str, float]:
        """Resources of one worker: its bundle in the worker group's placement group."""
        bundle = {"CPU": float(self.cpus_per_worker)}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        return bundle
