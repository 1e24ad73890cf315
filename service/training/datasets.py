"""Training data: learnable synthetic data and uploaded safetensors datasets.

An uploaded dataset is one safetensors file with two float tensors:
    linear:    inputs [N, in_features],   targets [N, out_features]
    attention: inputs [N, seq, E],        targets [N, seq, E]
and, for attention only, optionally `attention_mask` [N, seq] (BOOL, U8, I32 or I64; 1 = a
real token, 0 = padding, at least one token per sample): the loss ignores padded positions.
The kind is inferred from the rank (2-D or 3-D); a job checks it against its model.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.torch import load as st_load_torch
from safetensors.torch import load_file

from service.state import artifacts
from service.training.models import ModelSpecT, teacher_model
from service.training.spec import AttentionModel, LinearModel, SyntheticDataset

DATASET_KEYS = ("inputs", "targets")
MASK_KEY = "attention_mask"
_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
_MASK_DTYPES = (np.bool_, np.uint8, np.int32, np.int64)
# Decorrelates the teacher's weights from the inputs drawn with the same dataset seed.
_TEACHER_SEED_OFFSET = 7919


class DatasetError(ValueError):
    """The upload parsed but is not a usable dataset (names, dtypes, shapes, values)."""


class MalformedDataset(ValueError):
    """The upload is not a safetensors file at all."""


@dataclass(frozen=True)
class DatasetInfo:
    kind: str                 # "linear" | "attention"
    samples: int
    inputs_shape: list[int]
    targets_shape: list[int]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def synthetic(model: ModelSpecT, ds: SyntheticDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) with targets = teacher(inputs) + noise; same on every worker."""
    gen = torch.Generator().manual_seed(ds.seed)
    if isinstance(model, AttentionModel):
        x = torch.randn(ds.samples, ds.seq_len, model.embed_dim, generator=gen)
    else:
        x = torch.randn(ds.samples, model.in_features, generator=gen)
    teacher = teacher_model(model, ds.seed + _TEACHER_SEED_OFFSET)
    with torch.inference_mode():
        y = teacher(x)
    y = y + ds.noise * torch.randn(y.shape, generator=gen)
    return x.contiguous(), y.contiguous()


def parse_upload(body: bytes) -> tuple[DatasetInfo, dict[str, np.ndarray]]:
    """Validate an uploaded safetensors body; return its description and float32 tensors.

    Raises MalformedDataset (not safetensors) or DatasetError (wrong names/dtypes/shapes/values),
    each naming what was needed and what was found.
    """
    if not body:
        raise MalformedDataset("empty body: expected a safetensors file with tensors 'inputs' and 'targets'")
    try:
        tensors = st_load(body)
    except (SafetensorError, ValueError, OSError) as exc:
        raise MalformedDataset(f"body is not a valid safetensors file: {exc}") from None
    if sorted(set(tensors) - {MASK_KEY}) != sorted(DATASET_KEYS):
        raise DatasetError(
            f"expected the tensors {list(DATASET_KEYS)} (and optionally {MASK_KEY!r}), found {sorted(tensors)}"
        )
    out: dict[str, np.ndarray] = {}
    for key in DATASET_KEYS:
        arr = tensors[key]
        if arr.dtype.type not in _FLOAT_DTYPES:
            raise DatasetError(f"{key} has dtype {arr.dtype}; expected float16, float32 or float64")
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not np.isfinite(arr).all():
            raise DatasetError(f"{key} contains NaN or Inf values")
        out[key] = arr
    x, y = out["inputs"], out["targets"]
    if x.ndim not in (2, 3) or y.ndim != x.ndim:
        raise DatasetError(
            f"inputs {list(x.shape)} / targets {list(y.shape)}: expected 2-D [N, in] / [N, out] (linear) "
            "or 3-D [N, seq, E] / [N, seq, E] (attention)"
        )
    if x.shape[0] < 1 or x.shape[0] != y.shape[0]:
        raise DatasetError(f"inputs has {x.shape[0]} samples, targets {y.shape[0]}: need the same N >= 1")
    if x.ndim == 3 and x.shape != y.shape:
        raise DatasetError(f"attention data needs targets shaped like inputs: {list(x.shape)} vs {list(y.shape)}")
    if 0 in x.shape or 0 in y.shape:
        raise DatasetError(f"empty dimension in inputs {list(x.shape)} / targets {list(y.shape)}")
    if MASK_KEY in tensors:
        out[MASK_KEY] = _check_mask(tensors[MASK_KEY], x.shape)
    info = DatasetInfo(
        kind="attention" if x.ndim == 3 else "linear",
        samples=int(x.shape[0]),
        inputs_shape=[int(d) for d in x.shape],
        targets_shape=[int(d) for d in y.shape],
    )
    return info, out


def _check_mask(mask: np.ndarray, inputs_shape: tuple[int, ...]) -> np.ndarray:
    """The dataset's attention mask as [N, seq] uint8 0/1, or DatasetError naming the problem."""
    if len(inputs_shape) != 3:
        raise DatasetError(f"{MASK_KEY} is for attention data (inputs [N, seq, E]); inputs are {list(inputs_shape)}")
    if mask.dtype.type not in _MASK_DTYPES:
        raise DatasetError(f"{MASK_KEY} has dtype {mask.dtype}; expected bool, uint8, int32 or int64 (0/1)")
    if mask.shape != inputs_shape[:2]:
        raise DatasetError(f"{MASK_KEY} must be [N, seq] = {list(inputs_shape[:2])}; found {list(mask.shape)}")
    if not ((mask == 0) | (mask == 1)).all():
        raise DatasetError(f"{MASK_KEY} must hold only 0 (padding) and 1 (token)")
    empty = np.flatnonzero(~mask.astype(bool).any(axis=1))
    if empty.size:
        raise DatasetError(f"{MASK_KEY} marks every position of sample(s) {empty[:5].tolist()} as padding")
    return np.ascontiguousarray(mask, dtype=np.uint8)


def check_compatible(model: ModelSpecT, info: DatasetInfo) -> None:
    """DatasetError unless the dataset's shapes fit the model."""
    if isinstance(model, AttentionModel):
        if info.kind != "attention" or info.inputs_shape[2] != model.embed_dim:
            raise DatasetError(
                f"an attention model with embed_dim {model.embed_dim} needs inputs/targets "
                f"[N, seq, {model.embed_dim}]; the dataset has inputs {info.inputs_shape}, targets {info.targets_shape}"
            )
        return
    assert isinstance(model, LinearModel)
    if info.kind != "linear" or info.inputs_shape[1] != model.in_features or info.targets_shape[1] != model.out_features:
        raise DatasetError(
            f"a linear model {model.in_features} -> {model.out_features} needs inputs [N, {model.in_features}] and "
            f"targets [N, {model.out_features}]; the dataset has inputs {info.inputs_shape}, targets {info.targets_shape}"
        )


def load_uploaded(ref: str | Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, targets, attention mask [N, seq] bool or None) of a stored dataset: `ref` is
    its artifact key (read through the store, so a worker on any node reads it from object
    storage) or a legacy absolute path."""
    if Path(ref).is_absolute():
        tensors = load_file(str(ref))
    else:
        tensors = st_load_torch(artifacts.store().read_bytes(str(ref)))
    mask = tensors.get(MASK_KEY)
    return (tensors["inputs"].to(torch.float32), tensors["targets"].to(torch.float32),
            None if mask is None else mask.to(torch.bool))
