"""Training the model a gang serves: `model: {"kind": "transformer", ...}` jobs.

Units: the spec (closed, bounded, divisibility named), the checkpoint format (a job's
checkpoint loads into torch's own nn.TransformerEncoder with `strict=True` and computes what
it computes), the architecture checks of `init_from` and `POST /weights`. One Ray test
deploys a small transformer app, fine-tunes what it serves, gates, serves and rolls back the
job, and refuses a job of another architecture. References are torch's own modules in
float64, built here from torch's classes, never from the code under test.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import load as st_load_torch
from safetensors.torch import load_file
from torch import nn

from tests.conftest import deploy, local_yaml_args, undeploy
from tests.helpers import AUTH, SMALL, assert_error, post, train_and_save, wait_done
from tests.reference import relative_error

ARCH = {"num_layers": 2, "embed_dim": 64, "num_heads": 4, "ffn_dim": 128}


def torch_encoder(num_layers: int, embed_dim: int, num_heads: int, ffn_dim: int, activation: str = "relu",
                  norm_first: bool = False, layer_norm_eps: float = 1e-5) -> nn.TransformerEncoder:
    """torch's own module, float64, eval: the reference every check compares with."""
    layer = nn.TransformerEncoderLayer(embed_dim, num_heads, ffn_dim, dropout=0.0, activation=activation,
                                       batch_first=True, norm_first=norm_first, layer_norm_eps=layer_norm_eps)
    return nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False).double().eval()


def torch_forward(module: nn.TransformerEncoder, x: torch.Tensor, pad: torch.Tensor | None = None,
                  causal: bool = False) -> torch.Tensor:
    """torch's forward, float64: `pad` [batch, seq] True = padding (keys ignored); `causal`:
    the upper triangle masked."""
    seq = x.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1) if causal else None  # True: j > i, not attended
    with torch.inference_mode():
        return module(x.double(), mask=mask, src_key_padding_mask=pad, is_causal=causal)


# ---- units (no Ray) ------------------------------------------------------------------------

@pytest.mark.unit
def test_the_transformer_spec_is_closed_bounded_and_defaults_to_the_serving_defaults() -> None:
    from service.config.builder_args import ModelConfig
    from service.training.spec import JobSpec, TransformerModel

    spec = JobSpec.model_validate({"model": {"kind": "transformer"}})
    assert isinstance(spec.model, TransformerModel)
    served = ModelConfig(model="transformer")
    for name in ("num_layers", "embed_dim", "num_heads", "ffn_dim", "activation", "norm_first", "layer_norm_eps"):
        assert getattr(spec.model, name) == getattr(served, name), name
    assert spec.model.causal is False
    full = {"kind": "transformer", **ARCH, "activation": "gelu", "norm_first": True, "layer_norm_eps": 1e-6,
            "causal": True}
    assert JobSpec.model_validate({"model": full}).model.model_dump() == full

    def refused(model: dict[str, Any], *words: str, **job: Any) -> None:
        with pytest.raises(ValidationError) as info:
            JobSpec.model_validate({"model": {"kind": "transformer", **model}, **job})
        assert all(w in str(info.value) for w in words), str(info.value)

    refused({"embed_dim": 100, "num_heads": 3}, "embed_dim (100) must be divisible by num_heads (3)")
    refused({"num_layers": 0}, "num_layers")
    refused({"num_layers": 65}, "num_layers")
    refused({"ffn_dim": 0}, "ffn_dim")
    refused({"embed_dim": 8193}, "embed_dim")
    refused({"layer_norm_eps": 0}, "layer_norm_eps")
    refused({"activation": "tanh"}, "activation")
    refused({"in_features": 10}, "in_features")  # closed: another kind's field
    refused({"num_layers": 64, "embed_dim": 8192, "ffn_dim": 32768}, "transformer too large", "parameters")
    refused({"embed_dim": 4096, "num_heads": 8}, "synthetic dataset too large", "67108864",
            dataset={"samples": 4096, "seq_len": 8})


@pytest.mark.unit
def test_the_tensors_a_checkpoint_holds_are_torchs_module_s() -> None:
    """The tensors training expects of a transformer's and an attention layer's checkpoint (the
    one declaration in service.models) are torch's own modules' state_dict, for every option;
    the app's architecture and the job's are the same description."""
    from service.config.builder_args import ModelConfig
    from service.training.checkpoints import expected_tensors, spec_architecture
    from service.training.spec import AttentionModel, TransformerModel
    from service.weights.targets import served_architecture

    for arch in ({**ARCH}, {"num_layers": 3, "embed_dim": 16, "num_heads": 2, "ffn_dim": 24, "activation": "gelu",
                            "norm_first": True, "layer_norm_eps": 1e-6}):
        spec = TransformerModel(**arch)
        module = torch_encoder(**arch)
        assert expected_tensors(spec) == {k: tuple(v.shape) for k, v in module.state_dict().items()}
        assert served_architecture(ModelConfig(model="transformer", **arch)) == spec_architecture(spec)
    mha = nn.MultiheadAttention(64, 4, bias=True, batch_first=True)
    attention = AttentionModel(embed_dim=64, num_heads=4)
    assert expected_tensors(attention) == {
        f"{p}.{k}": tuple(getattr(mha.out_proj, k).shape) for p in ("q_proj", "k_proj", "v_proj", "out_proj")
        for k in ("weight", "bias")}
    assert served_architecture(ModelConfig(embed_dim=64, num_heads=4)) == spec_architecture(attention)
    assert served_architecture(ModelConfig(model="tests.models:tiny")) is None  # a user's model: the gang checks


@pytest.mark.unit
@pytest.mark.parametrize("causal", [False, True])
def test_a_job_checkpoint_loads_into_torchs_encoder_strictly_and_computes_the_same(tmp_path: Path,
                                                                                   causal: bool) -> None:
    """The worker's checkpoint of a (trained) transformer is torch's state_dict: strict load,
    equal tensors; the training forward (masks and causal the serving contract's) equals
    torch's module on every token row; resuming loads it back exactly."""
    from service.training.checkpoints import fit_problems, read_architecture
    from service.training.models import build_model, load_model
    from service.training.spec import TransformerModel

    arch = {"num_layers": 2, "embed_dim": 16, "num_heads": 4, "ffn_dim": 24, "activation": "gelu"}
    spec = TransformerModel(**arch, causal=causal)
    model = build_model(spec, seed=1)
    x, y = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
    tokens = torch.ones(4, 6, dtype=torch.bool)
    tokens[1, 4:] = False  # right padding: torch's own causal forward stays finite on every row
    tokens[2, 2:] = False
    path = tmp_path / "model.safetensors"
    train_and_save(model, spec, x, y, tokens, path)

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta == {"model": "transformer", "num_layers": "2", "embed_dim": "16", "num_heads": "4", "ffn_dim": "24",
                    "activation": "gelu", "norm_first": "false", "layer_norm_eps": "1e-05",
                    "causal": "true" if causal else "false"}
    reference = torch_encoder(**arch)
    saved = load_file(str(path))
    # Not strict, so that a difference is named here rather than raised: every name, no wrapper prefix.
    incompatible = reference.load_state_dict(saved, strict=False)
    assert (incompatible.missing_keys, incompatible.unexpected_keys) == ([], []), incompatible
    assert all(torch.equal(reference.state_dict()[k].float(), v) for k, v in saved.items())
    found, shapes = read_architecture(path)
    assert fit_problems(spec, found, shapes) == []
    assert fit_problems(TransformerModel(**{**arch, "num_layers": 1}), found, shapes) == [
        "num_layers=2, the model needs 1"]

    want = torch_forward(reference, x, pad=~tokens, causal=causal)
    with torch.no_grad():
        got = model.double()(x.double(), tokens)
        unmasked = model(x.double())
    assert relative_error(got[tokens], want[tokens]) < 1e-10
    assert not got[~tokens].any()  # padded positions answer 0, as the gang does
    assert relative_error(unmasked, torch_forward(reference, x, causal=causal)) < 1e-10

    resumed = build_model(spec, seed=2)
    load_model(resumed, spec, path)
    assert all(torch.equal(a, saved[k]) for k, a in resumed.module.state_dict().items())


@pytest.mark.unit
def test_init_from_a_transformer_apps_generated_weights_needs_its_architecture(tmp_path: Path) -> None:
    from service.config.builder_args import ModelConfig
    from service.contract.errors import InvalidInput
    from service.parallel.transformer import TransformerDef
    from service.state import artifacts
    from service.training import init_from
    from service.training.spec import AttentionModel, InitFrom, TransformerModel
    from service.training.store import JobStore
    from service.weights.declared import describe_config_weights
    from service.weights.record import WeightsRecord

    store = artifacts.open_store(str(tmp_path), local_state=tmp_path)
    jobs = JobStore(tmp_path / "jobs.sqlite")
    record = WeightsRecord(tmp_path, jobs.database)
    arch = {"num_layers": 1, "embed_dim": 16, "num_heads": 2, "ffn_dim": 32}
    app_model = ModelConfig(model="transformer", **arch, init="random", seed=3)
    record.reconcile("app", describe_config_weights(app_model))  # version 1: generated by init

    def resolve(model: Any) -> init_from.Resolved:
        return init_from.resolve(InitFrom(weights_version="current"), model, jobs=jobs, store=store, weights=record,
                                 app="app", app_model=app_model)

    got = resolve(TransformerModel(**arch, causal=True))
    assert got.record["weights_version"] == 1 and got.temp
    module = torch_encoder(**arch)
    module.load_state_dict(load_file(str(got.local)), strict=True)  # the job loads it as its student
    served = TransformerDef(**arch).init_weights("random", 3)
    assert all(torch.equal(module.state_dict()[k].float(), v) for k, v in served.items())
    got.cleanup()

    temps = set(Path(tempfile_dir()).glob("gangserve-init-*"))
    for model, words in ((TransformerModel(**{**arch, "num_layers": 2, "ffn_dim": 64}),
                          ("transformer num_layers 1, embed_dim 16, num_heads 2, ffn_dim 32",
                           "transformer num_layers 2, embed_dim 16, num_heads 2, ffn_dim 64",
                           "num_layers=1, the model needs 2", "ffn_dim=32, the model needs 64")),
                         (AttentionModel(embed_dim=16, num_heads=2),
                          ("transformer num_layers 1", "attention embed_dim 16, num_heads 2",
                           "kind=transformer, the model needs attention"))):
        with pytest.raises(InvalidInput) as info:
            resolve(model)
        assert info.value.code == "init_from_mismatch", info.value.message
        assert all(w in info.value.message for w in words), info.value.message
    assert set(Path(tempfile_dir()).glob("gangserve-init-*")) == temps  # refused before generating
    jobs.close()


def tempfile_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


@pytest.mark.unit
def test_post_weights_needs_the_apps_architecture(tmp_path: Path) -> None:
    from service.config.builder_args import ModelConfig
    from service.contract.errors import Conflict
    from service.state import artifacts
    from service.training.checkpoints import spec_architecture
    from service.training.spec import AttentionModel, LinearModel, TransformerModel
    from service.weights.targets import JobCheckpoint, job_target, served_architecture

    store = artifacts.open_store(str(tmp_path), local_state=tmp_path)
    store.write_bytes("checkpoints/job-a.safetensors", b"weights")
    served = served_architecture(ModelConfig(model="transformer", **ARCH))

    def target(model: Any, app: Any = served) -> dict[str, Any]:
        job = JobCheckpoint("job-a", "SUCCEEDED", None, "checkpoints/job-a.safetensors", spec_architecture(model))
        return job_target(store, job, app)

    assert target(TransformerModel(**ARCH)) == {"path": "checkpoints/job-a.safetensors", "job_id": "job-a",
                                                "embed_dim": 64, "num_heads": 4}
    assert target(TransformerModel(**ARCH, causal=True))["job_id"] == "job-a"  # causal: the served default only
    assert target(TransformerModel(**{**ARCH, "num_layers": 3}), None)["job_id"] == "job-a"  # the gang checks
    for model, words in (
            (TransformerModel(**{**ARCH, "num_heads": 8, "activation": "gelu"}),
             ("trained transformer num_layers 2, embed_dim 64, num_heads 8, ffn_dim 128, activation gelu",
              "this app serves transformer num_layers 2, embed_dim 64, num_heads 4, ffn_dim 128, activation relu",
              "num_heads=8, the model needs 4", "activation=gelu, the model needs relu")),
            (AttentionModel(embed_dim=64, num_heads=4),
             ("trained attention embed_dim 64, num_heads 4", "this app serves transformer",
              "kind=attention, the model needs transformer")),
            (LinearModel(), ("trained a linear model (linear 10 -> 1)", "this app serves transformer"))):
        with pytest.raises(Conflict) as info:
            target(model)
        assert info.value.code == "checkpoint_mismatch", info.value.message
        assert all(w in info.value.message for w in words), info.value.message


@pytest.mark.unit
def test_sequence_datasets_fit_a_transformer_of_their_width() -> None:
    from service.training.dataset_files import DatasetError, DatasetInfo, check_compatible
    from service.training.datasets import synthetic
    from service.training.spec import SyntheticDataset, TransformerModel

    model = TransformerModel(num_layers=1, embed_dim=16, num_heads=2, ffn_dim=32)
    check_compatible(model, DatasetInfo("attention", 8, [8, 4, 16], [8, 4, 16]))
    for info in (DatasetInfo("attention", 8, [8, 4, 32], [8, 4, 32]), DatasetInfo("linear", 8, [8, 16], [8, 16])):
        with pytest.raises(DatasetError, match=r"a transformer model with embed_dim 16 needs inputs/targets \[N, seq, 16\]"):
            check_compatible(model, info)
    x, y = synthetic(model, SyntheticDataset(samples=10, seq_len=3, noise=0))
    assert x.shape == y.shape == (10, 3, 16) and torch.isfinite(y).all() and y.std() > 0.5  # post-norm rows


# ---- Ray: train what a transformer app serves, serve it, roll back --------------------------

@pytest.mark.ray
def test_a_transformer_job_fine_tunes_is_served_and_rolled_back(serve_url: str) -> None:
    name = "transformer-training"
    base = deploy(serve_url, name, f"/{name}", {**local_yaml_args(), "world_size": 2, "model": "transformer", **ARCH,
                                                "init": "random", "seed": 5, "cpus_per_rank": 0.25})
    try:
        _fine_tune_serve_and_roll_back(base)
    finally:
        undeploy(name)


def _fine_tune_serve_and_roll_back(base: str) -> None:
    t0 = time.monotonic()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 64), dtype=np.float32)
    tokens = np.ones((2, 5), dtype=np.int64)
    tokens[1, 3:] = 0  # right padding (torch's own causal forward stays finite)

    def infer(mask: np.ndarray | None = None) -> torch.Tensor:
        body: dict[str, Any] = {"hidden_states": x.tolist()}
        if mask is not None:
            body["attention_mask"] = mask.tolist()
        reply = httpx.post(base + "/infer", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return torch.tensor(reply.json()["output"], dtype=torch.float64)

    config_answer = infer()
    model = {"kind": "transformer", **ARCH, "causal": True}
    spec = {**SMALL, "model": model, "init_from": {"weights_version": "current"},
            "dataset": {"samples": 32, "seq_len": 4, "seed": 1, "validation_fraction": 0.25},
            "epochs": 2, "batch_size": 8, "optimizer": "adam", "lr": 0.001}
    reply = post(base, "/train", spec)
    assert reply.status_code == 202, reply.text
    job_id = reply.json()["id"]

    # While it trains: another architecture is refused, naming both, at submit and at POST /weights.
    other = {"kind": "transformer", **ARCH, "num_layers": 1}
    doc = assert_error(post(base, "/train", {**spec, "model": other}), 422, "init_from_mismatch")
    assert "num_layers=2, the model needs 1" in doc["error"], doc
    wrong = post(base, "/train", {**SMALL, "model": other, "world_size": 1, "epochs": 1,
                                  "dataset": {"samples": 8, "seq_len": 2}})
    assert wrong.status_code == 202, wrong.text
    try:
        doc = assert_error(post(base, "/weights", {"job_id": wrong.json()["id"]}), 409, "checkpoint_mismatch")
        assert "trained transformer num_layers 1, embed_dim 64" in doc["error"] and \
            "this app serves transformer num_layers 2, embed_dim 64" in doc["error"], doc
    finally:
        post(base, f"/train/{wrong.json()['id']}/cancel")

    job = wait_done(base, job_id)
    assert job["status"] == "SUCCEEDED", job
    assert job["init_from"]["weights_version"] == 1 and job["checkpoint"]["format"] == "dense-transformer"
    assert len(job["history"]) == 2 and all(h["eval_loss"] is not None for h in job["history"]), job["history"]
    blob = httpx.get(f"{base}/train/{job_id}/checkpoint", headers=AUTH, timeout=60)
    assert blob.status_code == 200, blob.text
    reference = torch_encoder(**ARCH)
    reference.load_state_dict(st_load_torch(blob.content), strict=True)

    assert_error(post(base, "/weights", {"job_id": job_id, "max_eval_loss": 1e-12}), 409, "eval_gate")
    swapped = post(base, "/weights", {"job_id": job_id}, timeout=330)
    assert swapped.status_code == 200, swapped.text
    # The checkpoint records causal: the served default follows it.
    xt = torch.from_numpy(x)
    assert relative_error(infer(), torch_forward(reference, xt, causal=True)) < 1e-5
    keep = torch.from_numpy(tokens.astype(bool))
    masked = infer(tokens)
    assert relative_error(masked[keep], torch_forward(reference, xt, pad=~keep, causal=True)[keep]) < 1e-5
    assert not masked[~keep].any()

    back = post(base, "/weights", {"version": 1}, timeout=330)
    assert back.status_code == 200, back.text
    assert back.json()["weights_version"] == swapped.json()["weights_version"] + 1
    assert relative_error(infer(), config_answer) < 1e-6
    print(f"transformer job: trained, served, rolled back in {time.monotonic() - t0:.1f}s")
