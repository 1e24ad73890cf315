"""Training any registered model: `model: {"kind": "llama" | "pkg.module:factory", ...}` jobs.

Units: a llama job's checkpoint loads into Hugging Face's own `LlamaModel` with
`load_state_dict(strict=True)` under its names and computes what it computes (float64); the
architecture a checkpoint records is the one its spec declares, and another is named. Ray:
examples/gated_mlp.py is trained by a job, served with `POST /weights {"job_id"}` and compared
with its dense module holding the job's checkpoint; a llama job is trained, refused by that
gang naming both architectures (409), and served by a llama gang. References are Hugging
Face's modules and the example's own dense module, never the code under test.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load_torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaModel

from examples.gated_mlp import GatedMLPDef
from tests.conftest import deploy, local_yaml_args, undeploy
from tests.helpers import AUTH, SMALL, assert_error, post, train_and_save, wait_done
from tests.reference import relative_error

LLAMA_ARGS: dict[str, Any] = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "intermediate_size": 48, "rms_norm_eps": 1e-5,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def hf_llama(tensors: dict[str, torch.Tensor]) -> LlamaModel:
    """Hugging Face's LlamaModel of LLAMA_ARGS in float64 holding `tensors` (strict: every name
    of its state_dict but the token embedding, which a hidden-states model does not have)."""
    model = LlamaModel(LlamaConfig(**LLAMA_ARGS, vocab_size=8)).double().eval()
    model.embed_tokens = None  # type: ignore[assignment]  # hidden states in: no token lookup
    model.load_state_dict({k: v.double() for k, v in tensors.items()}, strict=True)
    return model


@pytest.mark.unit
def test_a_llama_job_checkpoint_loads_into_hugging_faces_model_strictly_and_computes_the_same(
        tmp_path: Path) -> None:
    from service.training.checkpoints import fit_problems, read_architecture
    from service.training.models import build_model, load_model
    from service.training.spec import JobSpec, RegisteredModel

    spec = JobSpec.model_validate({"model": {"kind": "llama", "model_args": LLAMA_ARGS}}).model
    assert isinstance(spec, RegisteredModel) and spec.width == 32
    model = build_model(spec, seed=1)
    x, y = torch.randn(3, 5, 32), torch.randn(3, 5, 32)
    tokens = torch.ones(3, 5, dtype=torch.bool)
    tokens[1, :2] = False  # left padding
    path = tmp_path / "model.safetensors"
    train_and_save(model, spec, x, y, tokens, path)

    saved = load_file(str(path))
    reference = hf_llama(saved)
    with torch.no_grad():
        want = reference(inputs_embeds=x.double()).last_hidden_state
        alone = reference(inputs_embeds=x[1, 2:][None].double()).last_hidden_state[0]
        got = model.double()(x.double())
        masked = model(x.double(), tokens)
    assert relative_error(got, want) < 1e-10
    assert relative_error(masked[1, 2:], alone) < 1e-10 and not masked[1, :2].any()

    found, shapes = read_architecture(path)
    assert found.kind == "llama" and fit_problems(spec, found, shapes) == []
    other = RegisteredModel(kind="llama", model_args={**LLAMA_ARGS, "intermediate_size": 64})
    assert fit_problems(other, found, shapes) == ["intermediate_size=48, the model needs 64"]

    resumed = build_model(spec, seed=2)
    load_model(resumed, spec, path)
    assert all(torch.equal(v, saved[k]) for k, v in resumed.module.state_dict().items())


@pytest.mark.unit
def test_a_registered_kind_s_spec_is_validated_and_names_what_is_missing() -> None:
    from pydantic import ValidationError

    from service.training.spec import JobSpec

    with pytest.raises(ValidationError, match="model examples.gated_mlp:gated_mlp: embed_dim is required"):
        JobSpec.model_validate({"model": {"kind": "examples.gated_mlp:gated_mlp"}})
    with pytest.raises(ValidationError, match="has no 'intermediate_size'"):
        JobSpec.model_validate({"model": {"kind": "llama", "model_args": {
            k: v for k, v in LLAMA_ARGS.items() if k != "intermediate_size"}}})
    with pytest.raises(ValidationError, match="embed_dim=16, but model_args' hidden_size is 32"):
        JobSpec.model_validate({"model": {"kind": "llama", "embed_dim": 16, "model_args": LLAMA_ARGS}})


def _infer(base: str, x: np.ndarray) -> torch.Tensor:
    reply = httpx.post(base + "/infer", json={"hidden_states": x.tolist()}, timeout=120)
    assert reply.status_code == 200, reply.text
    return torch.tensor(reply.json()["output"], dtype=torch.float64)


def _train(base: str, model: dict[str, Any]) -> str:
    spec = {**SMALL, "model": model, "world_size": 1, "epochs": 1, "batch_size": 8,
            "dataset": {"samples": 16, "seq_len": 4, "seed": 1}}
    reply = post(base, "/train", spec)
    assert reply.status_code == 202, reply.text
    return reply.json()["id"]


def _checkpoint(base: str, job_id: str) -> dict[str, torch.Tensor]:
    job = wait_done(base, job_id)
    assert job["status"] == "SUCCEEDED", job
    blob = httpx.get(f"{base}/train/{job_id}/checkpoint", headers=AUTH, timeout=60)
    assert blob.status_code == 200, blob.text
    return st_load_torch(blob.content)


@pytest.mark.ray
def test_a_users_module_is_trained_served_and_a_llama_job_is_refused_by_its_gang(serve_url: str) -> None:
    """examples/gated_mlp.py: a job trains its dense module; POST /weights serves the job's
    checkpoint at world size 2, equal to the example's dense module holding it (float64). A
    llama job trained beside it is refused by this gang with 409 naming both architectures."""
    name = "registered-training"
    base = deploy(serve_url, name, f"/{name}", {**local_yaml_args(), "world_size": 2,
                                                "model": "examples.gated_mlp:gated_mlp", "embed_dim": 16,
                                                "model_args": {"hidden_dim": 32}, "init": "random",
                                                "cpus_per_rank": 0.25})
    try:
        gated_job = _train(base, {"kind": "examples.gated_mlp:gated_mlp", "embed_dim": 16,
                                  "model_args": {"hidden_dim": 32}})
        llama_job = _train(base, {"kind": "llama", "model_args": {**LLAMA_ARGS, "hidden_size": 16}})
        tensors = _checkpoint(base, gated_job)
        arch = GatedMLPDef(16, 32)
        dense = arch.dense_module().double().eval()
        dense.load_state_dict({k: v.double() for k, v in tensors.items()}, strict=True)

        swapped = post(base, "/weights", {"job_id": gated_job}, timeout=330)
        assert swapped.status_code == 200, swapped.text
        x = np.random.default_rng(3).standard_normal((2, 5, 16)).astype(np.float32)
        with torch.no_grad():
            want = dense(torch.from_numpy(x).double())
        assert relative_error(_infer(base, x), want) < 1e-5

        _checkpoint(base, llama_job)  # finished, so the refusal is about its architecture
        doc = assert_error(post(base, "/weights", {"job_id": llama_job}), 409, "checkpoint_mismatch")
        assert "llama" in doc["error"] and "examples.gated_mlp:gated_mlp" in doc["error"], doc
    finally:
        undeploy(name)
