"""A rank's weight matmul (service.parallel.linear) against x W^T + b computed in float64,
every way a process may choose (the C++ few-row kernel beside oneDNN's packed weights, oneDNN
alone, torch's BLAS), and a weight changed in place (a swap) seen at the next call. The models'
own parity tests (test_models, test_llama, test_parallel_numerics, the served ones) run through
it too."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

from service.parallel import linear

pytestmark = pytest.mark.unit


@pytest.fixture(params=["native", "onednn", "blas"])
def reason(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each way a process may choose; the reason `configure` gave for it."""
    reason = linear.configure(request.param)
    yield reason
    linear.configure("native")  # the process default, for the tests after


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("shape", [(1, 768), (2, 768), (1, 1, 768), (2, 1, 3072), (4, 768), (70, 768), (3, 5, 768)])
@pytest.mark.parametrize("bias", [True, False])
def test_it_is_x_w_transposed_plus_b(reason: str, shape: tuple[int, ...], bias: bool) -> None:
    g = torch.Generator().manual_seed(1)
    out_f = 3072 if shape[-1] == 768 else 768  # [3072, 768] and [768, 3072]: a layer's two shapes
    w = torch.nn.Parameter(torch.randn(out_f, shape[-1], generator=g) / 28, requires_grad=False)
    b = torch.nn.Parameter(torch.randn(out_f, generator=g), requires_grad=False) if bias else None
    x = torch.randn(*shape, generator=g)
    with torch.inference_mode():
        got = linear.linear(x, w, b)
    assert got.shape == (*shape[:-1], out_f) and got.dtype == torch.float32
    assert _relative(got, _reference(x, w, b)) < 1e-6, reason


# torch's float64 ops as the reference: relu, and gelu's exact (erf) form, not its tanh one
_REFERENCE_ACTIVATIONS = {"relu": torch.relu, "gelu": lambda y: 0.5 * y * (1 + torch.erf(y / 2 ** 0.5))}


@pytest.mark.parametrize("rows", [1, 2, 4, 70])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_the_activation_is_applied_to_x_w_transposed_plus_b(reason: str, rows: int, activation: str) -> None:
    """An MLP's first matmul with its activation (every path applies it: the few-row kernel's
    epilogue, oneDNN's post-op, or torch's op after F.linear), in float64 for the reference."""
    g = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(3072, 768, generator=g) / 28, requires_grad=False)
    b = torch.nn.Parameter(torch.randn(3072, generator=g), requires_grad=False)
    x = torch.randn(rows, 768, generator=g)
    with torch.inference_mode():
        got = linear.linear(x, w, b, activation)  # type: ignore[arg-type]
    want = _REFERENCE_ACTIVATIONS[activation](_reference(x, w, b))
    assert _relative(got, want) < 1e-6, reason


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
    elif reason.startswith("1-2 rows"):  # native: this machine has a compiler
        assert reason.startswith("1-2 rows: the C++ kernel over the dense weights (gemv.cpp); more rows: oneDNN")
    else:
        assert reason.startswith("oneDNN's packed matmul") or "torch's BLAS" in reason  # a torch without the ops says so


def test_without_a_compiler_the_few_rows_take_onednn() -> None:
    """A process that cannot build the kernel says so and multiplies every row count with oneDNN
    (a fresh interpreter: a process that loaded the kernel keeps it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("from service.parallel import linear; import torch; print(linear.configure('native')); "
            "w = torch.randn(8, 4); x = torch.randn(1, 4); "
            "print(float((linear.linear(x, w) - x.double().float() @ w.T).abs().max()) < 1e-6)")
    env = {**os.environ, "CXX": "no-such-c++-compiler", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    reason, right = done.stdout.strip().splitlines()[-2:]
    assert reason.startswith("1-2 rows: oneDNN too, the C++ kernel is unavailable ($CXX='no-such-c++-compiler' "
                             "is not on PATH); more rows: oneDNN's packed matmul"), reason
    assert right == "True"


def _reference_norm(kind: str, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None) -> torch.Tensor:
    """The row norm in float64 from its definition (not torch's layer_norm)."""
    x = x.double()
    if kind == "layer":
        centered = x - x.mean(-1, keepdim=True)
        return centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double() + beta.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()


@pytest.mark.parametrize("rows", [1, 2, 70])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_a_row_norm_is_applied_before_the_matmul(reason: str, rows: int, kind: str) -> None:
    """norm(x) W^T + b, the norm computed by the few-row kernel for its rows (`prenormed` hands
    it on) or by torch before the matmul otherwise; both against the float64 definition."""
    g = torch.Generator().manual_seed(5)
    w = torch.nn.Parameter(torch.randn(1024, 768, generator=g) / 28, requires_grad=False)
    b = torch.nn.Parameter(torch.randn(1024, generator=g), requires_grad=False)
    x = torch.randn(rows, 768, generator=g) * 3 + 1  # rows far from normalized
    weight, beta = torch.rand(768, generator=g) + 0.5, torch.randn(768, generator=g) if kind == "layer" else None
    norm = linear.RowNorm(kind, weight, beta, 1e-5)  # type: ignore[arg-type]
    with torch.inference_mode():
        h, handed_on = linear.prenormed(x, norm, w)
        got = linear.linear(h, w, b, norm=handed_on)
    want = _reference_norm(kind, x, weight, beta) @ w.double().T + b.double()
    assert _relative(got, want) < 1e-6, reason
    assert "disagreed" not in reason, reason  # the kernel's probes (a norm, an activation) pass here
    kernel_computes = reason.startswith("1-2 rows: the C++ kernel") and rows <= linear.FEW_ROWS
    assert (handed_on is norm) == kernel_computes and (h is x) == kernel_computes


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_a_rotary_embedding_is_applied_to_each_output_head(reason: str, rows: int) -> None:
    """rotary(x W^T + b) head by head (the kernel rotates its rows' outputs; other paths rotate
    after the matmul), against the rotation written out in float64: for a head of width d and
    i < d/2, out[i] = y[i] cos[i] - y[i + d/2] sin[i], out[i + d/2] = y[i + d/2] cos[i + d/2] +
    y[i] sin[i + d/2], each row with its own angles."""
    g = torch.Generator().manual_seed(6)
    d, heads = 64, 4
    w = torch.nn.Parameter(torch.randn(heads * d, 256, generator=g) / 16, requires_grad=False)
    b = torch.nn.Parameter(torch.randn(heads * d, generator=g), requires_grad=False)
    x = torch.randn(rows, 256, generator=g)
    freqs = torch.rand(rows, 1, d // 2, generator=g) * 40
    angles = torch.cat((freqs, freqs), dim=-1)  # [rows, 1, d], as a Llama stack's positions make them
    with torch.inference_mode():
        got = linear.linear(x, w, b, rotary=linear.Rotary(angles.cos(), angles.sin(), d))
    y = _reference(x, w, b).view(rows, heads, d)
    cos, sin = angles.double().cos(), angles.double().sin()
    half = d // 2
    want = torch.empty_like(y)
    want[..., :half] = y[..., :half] * cos[..., :half] - y[..., half:] * sin[..., :half]
    want[..., half:] = y[..., half:] * cos[..., half:] + y[..., :half] * sin[..., half:]
    assert _relative(got, want.view(rows, heads * d)) < 1e-6, reason
    assert "disagreed" not in reason, reason
