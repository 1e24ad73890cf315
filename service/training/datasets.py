"""Training data for the workers: learnable synthetic data, and uploaded datasets (their
format and checks: service.training.dataset_files) loaded as tensors.

Validation: an upload may carry its own held-out set (`val_inputs` / `val_targets`).
Otherwise a job may hold out `validation_fraction` of the samples (synthetic data: 0.1 by
default): the last floor(N * fraction), never trained on (`split`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load_torch
from safetensors.torch import load_file

from service.state import artifacts
from service.training.dataset_files import DATASET_KEYS, MASK_KEY, VAL_KEYS, VAL_MASK_KEY
from service.training.models import teacher_model
from service.training.spec import AttentionModel, ModelSpecT, RegisteredModel, SyntheticDataset, TransformerModel

# Decorrelates the teacher's weights from the inputs drawn with the same dataset seed.
_TEACHER_SEED_OFFSET = 7919
# A transformer teacher labels the samples in chunks of at most this many activation elements
# (samples x seq x max(E, ffn_dim)), so its MLP's hidden activations stay small.
_TEACHER_CHUNK_ELEMENTS = 16 * 1024 * 1024


def synthetic(model: ModelSpecT, ds: SyntheticDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) with targets = teacher(inputs) + noise; same on every worker."""
    gen = torch.Generator().manual_seed(ds.seed)
    if isinstance(model, (AttentionModel, TransformerModel)):
        x = torch.randn(ds.samples, ds.seq_len, model.embed_dim, generator=gen)
    elif isinstance(model, RegisteredModel):
        x = torch.randn(ds.samples, ds.seq_len, model.width, generator=gen)
    else:
        x = torch.randn(ds.samples, model.in_features, generator=gen)
    teacher = teacher_model(model, ds.seed + _TEACHER_SEED_OFFSET)
    with torch.inference_mode():
        if isinstance(model, (TransformerModel, RegisteredModel)):
            # a registered kind's hidden width is its own: assume 4 E, as a transformer's MLP
            width = max(model.embed_dim, model.ffn_dim) if isinstance(model, TransformerModel) else 4 * model.width
            chunk = max(1, _TEACHER_CHUNK_ELEMENTS // (ds.seq_len * width))
            y = torch.cat([teacher(x[i:i + chunk]) for i in range(0, ds.samples, chunk)])
        else:
            y = teacher(x)
    y = y + ds.noise * torch.randn(y.shape, generator=gen)
    return x.contiguous(), y.contiguous()


@dataclass(frozen=True)
class Samples:
    """One set of samples: inputs, targets and (attention, transformer: optional) mask [N, seq] bool."""

    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.x, self.y) if self.mask is None else (self.x, self.y, self.mask)

    def take(self, index: slice) -> "Samples":
        return Samples(self.x[index], self.y[index], None if self.mask is None else self.mask[index])


def load_uploaded(ref: str | Path, store: artifacts.ArtifactStore) -> tuple[Samples, Samples | None]:
    """(training samples, the dataset's own validation samples or None) of a stored dataset:
    `ref` is its artifact key (read through `store`, so a worker on any node reads it from
    object storage) or a legacy absolute path."""
    if Path(ref).is_absolute():
        tensors = load_file(str(ref))
    else:
        tensors = st_load_torch(store.read_bytes(str(ref)))

    def samples(x: str, y: str, mask: str) -> Samples:
        m = tensors.get(mask)
        return Samples(tensors[x].to(torch.float32), tensors[y].to(torch.float32), None if m is None else m.to(torch.bool))

    train = samples(*DATASET_KEYS, MASK_KEY)
    return train, (samples(*VAL_KEYS, VAL_MASK_KEY) if VAL_KEYS[0] in tensors else None)


def validation_count(samples: int, fraction: float | None) -> int:
    """Samples a `fraction` holds out of `samples` (floor; the rest, at least one, is trained on)."""
    if not fraction:
        return 0
    return min(int(samples * fraction), samples - 1)


def split(data: Samples, fraction: float | None) -> tuple[Samples, Samples | None]:
    """(train, validation): the last validation_count(N, fraction) samples held out, or None."""
    held = validation_count(len(data), fraction)
    if not held:
        return data, None
    cut = len(data) - held
    return data.take(slice(0, cut)), data.take(slice(cut, None))
