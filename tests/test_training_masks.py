"""Training with masks and causal attention (issue 22), without Ray: the model, the loss,
the dataset's optional attention_mask, and the checkpoint's recorded `causal`."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save as st_save

from service.parallel.weights import checkpoint_causal, random_weights
from service.training.dataset_files import DatasetError, parse_upload
from service.training.models import SelfAttention, load_dense_into, save_model
from service.training.runner import vector_sq_error
from service.training.spec import AttentionModel, JobSpec
from tests.reference import dense_attention_masked, relative_error

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("causal", [False, True])
def test_trained_model_computes_the_served_function(causal: bool) -> None:
    weights = random_weights(64, seed=2)
    model = SelfAttention(64, 4, causal)
    load_dense_into(model, weights)
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, :5] = 0  # left padding: with causal, padded query 0 has no key at all
    with torch.no_grad():
        assert relative_error(model(x, mask), dense_attention_masked(weights, 4, x, mask, causal)) < 1e-5
        assert relative_error(model(x), dense_attention_masked(weights, 4, x, None, causal)) < 1e-5
    # Gradients stay finite through the padded rows (no all-masked softmax row).
    out = model(x.requires_grad_(), mask)
    vector_sq_error(out, torch.zeros_like(out), mask.bool()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_loss_ignores_padded_positions() -> None:
    out, target = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    target[0, 2] = 100.0  # padding: must not count
    target[1, 0] = 2.0  # a token: ||.||^2 = 16, over 4 token vectors
    mask = torch.tensor([[True, True, False], [True, True, False]])
    assert vector_sq_error(out, target, mask).item() == pytest.approx(16.0 / 4)
    assert vector_sq_error(out, target).item() == pytest.approx((4 * 100**2 + 16) / 6)


def test_dataset_may_carry_an_attention_mask() -> None:
    x = np.random.default_rng(0).standard_normal((4, 5, 8), dtype=np.float32)
    mask = np.array([[1, 1, 1, 0, 0]] * 4, dtype=np.int64)
    info, tensors = parse_upload(st_save({"inputs": x, "targets": x, "attention_mask": mask}))
    assert info.kind == "attention" and tensors["attention_mask"].dtype == np.uint8
    np.testing.assert_array_equal(tensors["attention_mask"], mask)
    for bad, needle in (
        (np.zeros((4, 5), np.int64), "every position"),
        (np.full((4, 5), 2, np.int64), "only 0"),
        (np.ones((4, 4), np.int64), "[4, 5]"),
        (np.ones((4, 5), np.float32), "dtype"),
    ):
        with pytest.raises(DatasetError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            parse_upload(st_save({"inputs": x, "targets": x, "attention_mask": bad}))


@pytest.mark.parametrize("causal", [False, True])
def test_checkpoint_records_causal(tmp_path: Path, causal: bool) -> None:
    spec = JobSpec.model_validate({"model": {"kind": "attention", "embed_dim": 16, "num_heads": 2, "causal": causal}})
    assert isinstance(spec.model, AttentionModel) and spec.model.causal is causal
    path = tmp_path / "model.safetensors"
    save_model(SelfAttention(16, 2, causal), spec.model, path)
    assert checkpoint_causal(path) is causal
    assert JobSpec.model_validate({}).model.causal is False  # type: ignore[union-attr]
