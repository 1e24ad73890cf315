"""A rank's weight matmul (service.parallel.linear) against x W^T + b computed in float64,
both ways a process may choose (oneDNN's packed weights, torch's BLAS), and a weight changed in
place (a swap) seen at the next call. The models' own parity tests (test_models, test_llama,
test_parallel_numerics, the served ones) run through it too."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

from service.parallel import linear

pytestmark = pytest.mark.unit


@pytest.fixture(params=["onednn", "blas"])
def reason(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each way a process may choose; the reason `configure` gave for it."""
    reason = linear.configure(request.param)
    yield reason
    linear.configure("onednn")  # the process default, for the tests after


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("shape", [(1, 768), (4, 768), (70, 768), (3, 5, 768)])
@pytest.mark.parametrize("bias", [True, False])
def test_it_is_x_w_transposed_plus_b(reason: str, shape: tuple[int, ...], bias: bool) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(3072, 768, generator=g) / 28, requires_grad=False)
    b = torch.nn.Parameter(torch.randn(3072, generator=g), requires_grad=False) if bias else None
    x = torch.randn(*shape, generator=g)
    with torch.inference_mode():
        got = linear.linear(x, w, b)
    assert got.shape == (*shape[:-1], 3072) and got.dtype == torch.float32
    assert _relative(got, _reference(x, w, b)) < 1e-6, reason


def test_a_weight_changed_in_place_is_packed_again(reason: str) -> None:
    """A weights swap copies into the same parameter: the next call multiplies by the new
    values (the packed copy follows the weight's version), and by the replaced storage too."""
    g = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter(torch.randn(64, 96, generator=g), requires_grad=False)
    x = torch.randn(2, 96, generator=g)
    with torch.inference_mode():
        first = w.detach().clone()
        before = linear.linear(x, w)
        with torch.no_grad():
            w.copy_(torch.randn(64, 96, generator=g))
        second = w.detach().clone()
        after = linear.linear(x, w)
        w.data = torch.randn(64, 96, generator=g)
        replaced = linear.linear(x, w)
    assert _relative(before, _reference(x, first, None)) < 1e-6
    assert _relative(after, _reference(x, second, None)) < 1e-6  # not the first values' packed copy
    assert _relative(replaced, _reference(x, w.detach(), None)) < 1e-6


def test_other_dtypes_and_autograd_take_f_linear(reason: str) -> None:
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(32, 16, generator=g), torch.randn(4, 16, generator=g)
    for dtype in (torch.bfloat16, torch.float64):
        assert torch.equal(linear.linear(x.to(dtype), w.to(dtype)), torch.nn.functional.linear(x.to(dtype), w.to(dtype)))
    trained = w.clone().requires_grad_(True)
    linear.linear(x, trained).sum().backward()  # F.linear: gradients flow
    assert trained.grad is not None and torch.allclose(trained.grad, x.sum(0).expand(32, 16))


def test_the_process_says_which_and_why(reason: str) -> None:
    assert linear.chosen() == reason
    if "blas" in reason:
        assert "tunables.gang.cpu_matmul is 'blas'" in reason
    else:
        assert reason.startswith("oneDNN's packed matmul") or "torch's BLAS" in reason  # a torch without the ops says so
