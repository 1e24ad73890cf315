"""An uploaded training dataset: what its safetensors file must hold, checked with numpy
(the JobManager, which validates uploads, loads no torch; tests/test_layout.py).

An uploaded dataset is one safetensors file with two float tensors:
    linear:    inputs [N, in_features],   targets [N, out_features]
    attention: inputs [N, seq, E],        targets [N, seq, E]   (sequence data: attention and
                                                                 transformer models train on it)
and, for sequence data only, optionally `attention_mask` [N, seq] (BOOL, U8, I32 or I64; 1 = a
real token, 0 = padding, at least one token per sample): the loss ignores padded positions.
The kind is inferred from the rank (2-D or 3-D); a job checks it against its model.

Validation: an upload may also carry its own held-out set, `val_inputs` / `val_targets` (and,
for attention, `val_attention_mask`), shaped like the training tensors but for M samples.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load

from service.training.spec import AttentionModel, LinearModel, ModelSpecT, RegisteredModel, TransformerModel

DATASET_KEYS = ("inputs", "targets")
MASK_KEY = "attention_mask"
VAL_KEYS = ("val_inputs", "val_targets")
VAL_MASK_KEY = "val_attention_mask"
_OPTIONAL_KEYS = {MASK_KEY, *VAL_KEYS, VAL_MASK_KEY}
_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
_MASK_DTYPES = (np.bool_, np.uint8, np.int32, np.int64)

class DatasetError(ValueError):
    """The upload parsed but is not a usable dataset (names, dtypes, shapes, values)."""


class MalformedDataset(ValueError):
    """The upload is not a safetensors file at all."""


@dataclass(frozen=True)
class DatasetInfo:
    kind: str                 # "linear" | "attention" (3-D sequence data, for attention and transformer)
    samples: int
    inputs_shape: list[int]
    targets_shape: list[int]
    validation_samples: int = 0  # of its own val_inputs / val_targets

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


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
    if sorted(set(tensors) - _OPTIONAL_KEYS) != sorted(DATASET_KEYS) or (
            len(set(VAL_KEYS) & set(tensors)) == 1 or (VAL_MASK_KEY in tensors and VAL_KEYS[0] not in tensors)):
        raise DatasetError(
            f"expected the tensors {list(DATASET_KEYS)} (and optionally {MASK_KEY!r}; for validation both of "
            f"{list(VAL_KEYS)}, optionally {VAL_MASK_KEY!r}), found {sorted(tensors)}"
        )
    out: dict[str, np.ndarray] = {}
    for key in (*DATASET_KEYS, *(k for k in VAL_KEYS if k in tensors)):
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
    validation = 0
    if VAL_KEYS[0] in out:
        vx, vy = out[VAL_KEYS[0]], out[VAL_KEYS[1]]
        if vx.shape[1:] != x.shape[1:] or vy.shape[1:] != y.shape[1:] or vx.shape[0] != vy.shape[0] or not vx.shape[0]:
            raise DatasetError(
                f"val_inputs {list(vx.shape)} / val_targets {list(vy.shape)} must be shaped like inputs "
                f"{list(x.shape)} / targets {list(y.shape)} except for their (equal, >= 1) sample count"
            )
        if VAL_MASK_KEY in tensors:
            out[VAL_MASK_KEY] = _check_mask(tensors[VAL_MASK_KEY], vx.shape, VAL_MASK_KEY)
        validation = int(vx.shape[0])
    info = DatasetInfo(
        kind="attention" if x.ndim == 3 else "linear",
        samples=int(x.shape[0]),
        inputs_shape=[int(d) for d in x.shape],
        targets_shape=[int(d) for d in y.shape],
        validation_samples=validation,
    )
    return info, out


def _check_mask(mask: np.ndarray, inputs_shape: tuple[int, ...], name: str = MASK_KEY) -> np.ndarray:
    """The dataset's attention mask as [N, seq] uint8 0/1, or DatasetError naming the problem."""
    if len(inputs_shape) != 3:
        raise DatasetError(f"{name} is for attention data (inputs [N, seq, E]); inputs are {list(inputs_shape)}")
    if mask.dtype.type not in _MASK_DTYPES:
        raise DatasetError(f"{name} has dtype {mask.dtype}; expected bool, uint8, int32 or int64 (0/1)")
    if mask.shape != inputs_shape[:2]:
        raise DatasetError(f"{name} must be [N, seq] = {list(inputs_shape[:2])}; found {list(mask.shape)}")
    if not ((mask == 0) | (mask == 1)).all():
        raise DatasetError(f"{name} must hold only 0 (padding) and 1 (token)")
    empty = np.flatnonzero(~mask.astype(bool).any(axis=1))
    if empty.size:
        raise DatasetError(f"{name} marks every position of sample(s) {empty[:5].tolist()} as padding")
    return np.ascontiguousarray(mask, dtype=np.uint8)


def check_compatible(model: ModelSpecT, info: DatasetInfo) -> None:
    """DatasetError unless the dataset's shapes fit the model."""
    if isinstance(model, (AttentionModel, TransformerModel, RegisteredModel)):
        width = model.width if isinstance(model, RegisteredModel) else model.embed_dim
        if info.kind != "attention" or info.inputs_shape[2] != width:
            raise DatasetError(
                f"{'an' if model.kind == 'attention' else 'a'} {model.kind} model with embed_dim {width} needs inputs/targets "
                f"[N, seq, {width}]; the dataset has inputs {info.inputs_shape}, targets {info.targets_shape}"
            )
        return
    assert isinstance(model, LinearModel)
    if info.kind != "linear" or info.inputs_shape[1] != model.in_features or info.targets_shape[1] != model.out_features:
        raise DatasetError(
            f"a linear model {model.in_features} -> {model.out_features} needs inputs [N, {model.in_features}] and "
            f"targets [N, {model.out_features}]; the dataset has inputs {info.inputs_shape}, targets {info.targets_shape}"
        )
