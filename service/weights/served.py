"""The served weights' values, and their immutable files in the artifact store: one recorded
version (`ServedWeights`), the app's declared weights (`ConfigWeights`), and the copy and check
of a version's checkpoint file.

What a gang, the ingress, the rollout and training need of the served weights, without the
state database: the durable record itself (the `served_weights` table, its rule and its
transactions) is service.weights.record, which only the Controller and the JobManager open.
Kept apart so those processes do not import SQLAlchemy (~0.3 s of CPU at every process start).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from service.config.builder_args import ModelConfig
from service.state import artifacts

WEIGHTS_SUBDIR = "weights"

Source = Literal["config", "swap"]


class WeightsRecordError(RuntimeError):
    """The recorded weights cannot be served as recorded (file missing or altered)."""


@dataclass(frozen=True)
class ServedWeights:
    """One recorded version of an app's weights."""

    app: str
    version: int
    source: Source
    description: str
    sha256: str
    fingerprint: str
    checkpoint: str | None = None
    job_id: str | None = None
    recorded_at: float = 0.0
    superseded_at: float | None = None
    eval_loss: float | None = None
    rollback_of: int | None = None

    def model_config(self, declared: ModelConfig) -> ModelConfig:
        """What the ranks load: the declared shape and init, with this version's checkpoint
        (an artifact key or an absolute local path; each rank resolves it through the
        artifact store, see service.gang.rank.load_rank_shard)."""
        return declared.model_copy(update={"checkpoint": self.checkpoint})

    def public(self) -> dict[str, object]:
        """The /gang fields (no file-system paths)."""
        return {
            "weights_version": self.version,
            "weights_source": self.source,
            "weights_sha256": self.sha256,
            "weights_description": self.description,
        }


# ---- the immutable copies --------------------------------------------------------------------

def _store_at(where: Path | artifacts.ArtifactStore) -> artifacts.ArtifactStore:
    """`where` as a store: a store as it is, a directory as the local store rooted there."""
    if isinstance(where, artifacts.ArtifactStore):
        return where
    return artifacts.open_store(str(where), local_state=Path(where))


def store_immutable_copy(src: str | os.PathLike[str], where: Path | artifacts.ArtifactStore,
                         sha256: str | None = None) -> tuple[str, str]:
    """Copy the local file `src` to `weights/<sha256>.safetensors` in the artifact store.

    Hashes while copying (the sha is of the bytes written) and writes atomically (temp
    file, fsync and rename, read-only, in a local store; one PUT on S3), so a crash never
    leaves a partial object under a content name. Returns (key, sha256). An existing copy
    with the same content is reused, never overwritten. `where` is the store, or a
    directory (its local store)."""
    return _store_at(where).put_immutable(WEIGHTS_SUBDIR, src, sha256)


def verify_recorded_file(weights: ServedWeights, where: Path | artifacts.ArtifactStore) -> None:
    """Raise WeightsRecordError unless the recorded checkpoint exists with its recorded
    sha256 (on S3 this also puts the verified copy into this node's cache, where rank 0
    and the ranks sharing its node load it from). StorageUnavailable if the store is down."""
    if weights.checkpoint is None:
        return
    store = _store_at(where)
    shown = weights.checkpoint if os.path.isabs(weights.checkpoint) else f"{store.url}/{weights.checkpoint}"
    try:
        store.materialize(weights.checkpoint, weights.sha256)
    except artifacts.ArtifactCorrupt as exc:
        raise WeightsRecordError(
            f"recorded weights version {weights.version} ({weights.description}): {exc}; "
            "refusing to serve altered weights"
        ) from None
    except (OSError, ValueError) as exc:
        raise WeightsRecordError(
            f"recorded weights version {weights.version} ({weights.description}) cannot be read "
            f"from {shown}: {getattr(exc, 'strerror', None) or exc}"
        ) from None


# ---- the app's declared (config) weights, as the record compares them ---------------------

@dataclass(frozen=True)
class ConfigWeights:
    """What the app's builder arguments declare, hashed once per replica start."""

    description: str
    sha256: str
    checkpoint: str | None
    fingerprint: str
