"""The app's declared weights, hashed: what its builder arguments say it serves.

`describe_config_weights` hashes the configured checkpoint file, or the tensors `init`
generates, into the fingerprint the record (service.weights.record) compares at every
bring-up; `dense_sha256` is the one hash of dense tensors (float32, C order, in DENSE_KEYS
order), also used to verify a rollback to `init` weights. Its own module because it needs
torch, and the record does not: the ingress reads the record's types and imports no torch
(tests/test_layout.py)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from service.config import ModelConfig
from service.parallel.weights import DENSE_KEYS, random_weights, seed_weights
from service.state import artifacts
from service.tunables import StateTunables
from service.weights.record import ConfigWeights


def dense_sha256(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over the dense tensors in DENSE_KEYS order (float32, C order, native bytes)."""
    digest = hashlib.sha256()
    for key in DENSE_KEYS:
        digest.update(weights[key].detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def describe_config_weights(model: ModelConfig, tunables: StateTunables | None = None) -> ConfigWeights:
    """Hash the configured weights (the checkpoint file, read in the state `tunables`'
    copy_chunk_bytes, or the tensors `init` generates)."""
    if model.checkpoint:
        sha = artifacts.file_sha256(model.checkpoint, (tunables or StateTunables()).copy_chunk_bytes)
        description = f"checkpoint {Path(model.checkpoint).name}"
    else:
        dense = seed_weights(model.embed_dim) if model.init == "seed" else random_weights(model.embed_dim, model.seed)
        sha = dense_sha256(dense)
        description = "init=seed" if model.init == "seed" else f"init=random seed={model.seed}"
    declaration = {
        "embed_dim": model.embed_dim,
        "num_heads": model.num_heads,
        "weights": model.weights_source,
        "sha256": sha,
    }
    fingerprint = hashlib.sha256(json.dumps(declaration, sort_keys=True).encode()).hexdigest()
    return ConfigWeights(description, sha, model.checkpoint, fingerprint)
