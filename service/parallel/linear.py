"""y = act(norm(x) W^T + b) for a rank's weight matrices: on CPU in float32, one or two rows through this
package's C++ kernel (gemv.cpp) and more through oneDNN's packed matmul; else `F.linear` (torch's
BLAS, MKL in the CPU wheels).

Why: for the few rows of a decode step or a small request, MKL's float32 GEMV/GEMM ran the
12-layer E=768 stack's weights at 14.8 GB/s on a 2-core AMD EPYC (copy bandwidth 20-24 GB/s),
and 2 rows cost twice 1 row (a compute-bound path). oneDNN's matmul over a weight reordered once
into its blocked layout ran the same matrices 1.4-1.7x faster at 1 row, 2.5-3.5x at 4 rows,
~2x at 32 and 1.2-1.4x at 256 (bench/NOTES.md, session 23): an S = 1 decode step in process
went from ~50 to ~41 ms. These are the ops inductor's freezing uses for CPU linears
(`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`). For one or two rows (a decode
step of one or two appends, a one-row request) a plain pass over the dense weight reads it
faster still: gemv.cpp, 10.1 against oneDNN's 15.0 ms at one row over the same 340 MB (33.6
against 22.6 GB/s; 2 rows 14.3 against 17.5 ms, 4 rows even), built once per machine
(service.parallel.native).

Contract: `linear(x, weight, bias, activation, norm)` equals
`act(F.linear(norm(x), weight, bias))` up to float32 rounding (the order of a dot product's
additions differs), act the identity, F.relu or F.gelu (exact, erf), norm a `RowNorm` (layer or
RMS) or none. The activation is applied by the kernel that computed the product where it can
(gemv.cpp's epilogue, oneDNN's post-op), while each output is still in a register, and the few-row
kernel normalizes its rows itself: as torch ops around the matmul, a decode step's gelu cost
~0.8 ms of a 17 ms step and its layer norms ~0.6, their code and input cold after the pass over
the weights (`prenormed` hands a norm on only where the kernel will take it, so a norm read by
several matmuls is never computed once per matmul by torch). The packed copy of `weight` is made on its
first use and made again whenever the weight changed in place (its version counter, bumped by
`copy_`: a weights swap) or its storage was replaced, so it never serves stale weights. It is
a second copy of each matrix (the dense one stays: the fused encoder path, the checks and the
swaps read it): `configure` turns it off for a process (tunables.gang.cpu_matmul). The few-row
kernel reads the dense weight itself, so it never serves stale weights either.

Where each applies is decided once per process, by `configure` (a rank at bring-up) or on the
first call: CPU float32 tensors, the ops present in this torch (the kernel built here), and a
probe matmul that equals F.linear's. Anything else (CUDA, bf16/fp16, autograd, a weight that
is not contiguous for the kernel) takes the next path down, `F.linear` last.
"""
from __future__ import annotations

import ctypes
import logging
import weakref
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.nn.functional as F

from service.parallel.native import BuildFailed, load

log = logging.getLogger("gangserve.rank")

CpuMatmul = Literal["native", "onednn", "blas"]
Activation = Literal["identity", "relu", "gelu"]

# Each activation: the C++ kernel's code (gemv.cpp), oneDNN's post-op (name, algorithm), torch's op.
_KERNEL_CODES: dict[Activation, int] = {"identity": 0, "relu": 1, "gelu": 2}
_POST_OPS: dict[Activation, tuple[str, str]] = {"identity": ("none", ""), "relu": ("relu", ""),
                                                "gelu": ("gelu", "none")}  # "none": erf, not tanh
_TORCH_OPS: dict[Activation, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda y: y, "relu": F.relu, "gelu": F.gelu}
_NORM_CODES = {"layer": 1, "rms": 2}  # gemv.cpp's Norm (0: none)


@dataclass(frozen=True)
class RowNorm:
    """A normalization of each input row before a matmul, over its last dim of n:

    - "layer": (x - mean) / sqrt(var + eps) * weight + bias (var biased; nn.LayerNorm's);
    - "rms": x / sqrt(mean(x^2) + eps) * weight, the statistics in float32 and the product in
      x's dtype (transformers' LlamaRMSNorm), no bias.

    `apply` computes it with torch ops; `linear(..., norm=)` lets the few-row kernel compute it
    for its rows instead (`prenormed` says when)."""

    kind: Literal["layer", "rms"]
    weight: torch.Tensor  # [n]
    bias: torch.Tensor | None  # [n]; layer norm only (None: no bias)
    eps: float

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def kernel_args(self) -> tuple[int, int, int, float]:
        """gemv.cpp's norm, g, beta and eps arguments (the norm's tensors must outlive the call)."""
        return _NORM_CODES[self.kind], self.weight.data_ptr(), 0 if self.bias is None else self.bias.data_ptr(), self.eps

    def kernel_reads(self) -> bool:
        """Whether the few-row kernel can read this norm's parameters (contiguous float32)."""
        return all(t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu")
                   for t in (self.weight, self.bias))


_NO_NORM_ARGS = (0, 0, 0, 0.0)


def apply_rotary(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """y cos + rotate_half(y) sin over the last dim (y [..., heads, d]; cos/sin broadcast over the
    heads' dim), rotate_half(y) = cat(-y[d/2:], y[:d/2]) (transformers' apply_rotary_pos_emb)."""
    half = y.shape[-1] // 2
    rotated = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
    return y * cos + rotated * sin


@dataclass(frozen=True)
class Rotary:
    """The rotary position embedding of a matmul's output heads: y [..., heads * d] is rotated
    head by head (`apply_rotary`) with cos, sin [..., 1, d] (one angle set per row, the same for
    every head). `linear(..., rotary=)` lets the few-row kernel rotate its rows' outputs."""

    cos: torch.Tensor  # [..., 1, d]
    sin: torch.Tensor
    head_dim: int

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        return apply_rotary(y.unflatten(-1, (-1, self.head_dim)), self.cos, self.sin).flatten(-2)

    def kernel_args(self, rows: int) -> tuple[int, int, int] | None:
        """gemv.cpp's rope_cos, rope_sin and rope_dim for `rows` rows, or None where the kernel
        cannot read the angles (one [d] float32 set per row, contiguous)."""
        if not all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" and
                   t.numel() == rows * self.head_dim for t in (self.cos, self.sin)):
            return None
        return self.cos.data_ptr(), self.sin.data_ptr(), self.head_dim


_NO_ROTARY_ARGS = (0, 0, 0)

_PROBE_TOLERANCE = 1e-5  # relative max error of the probe against F.linear (float32 rounding: ~1e-7)
FEW_ROWS = 2  # at most this many rows go through the C++ kernel (gemv.cpp: measured)
SOURCE = "gemv.cpp"  # beside service.parallel.native
BUILD_BUDGET_S = 60.0  # the kernel's build, at most (~1 s measured); past it, oneDNN serves every row count


class _Packed:
    """The process's choice and its packed weights (one owner: this module)."""

    def __init__(self) -> None:
        self.enabled: bool | None = None  # oneDNN; None: not decided yet (decided on the first call)
        self.few_rows: ctypes._CFuncPtr | None = None  # the C++ kernel's entry point, where it serves
        self.reason = "not decided"
        # id(weight) -> (the weight, weakly; (storage pointer, version); packed), dropped with the
        # weight (a WeakKeyDictionary would compare tensors with ==, elementwise)
        self.weights: dict[int, tuple[weakref.ref[torch.Tensor], tuple[int, int], torch.Tensor]] = {}


_STATE = _Packed()


def configure(mode: CpuMatmul = "native") -> str:
    """Decide for this process (`mode` "blas": always F.linear; "onednn": oneDNN for every row
    count; "native": the few-row kernel too); returns which and why, in words (the rank logs it)."""
    _STATE.few_rows = None
    if mode == "blas":
        _STATE.enabled, _STATE.reason = False, "tunables.gang.cpu_matmul is 'blas': torch's BLAS (F.linear)"
    else:
        problem = _onednn_problem()
        _STATE.enabled = problem is None
        _STATE.reason = (problem or "oneDNN's packed matmul (weights reordered once; a second copy of each "
                                    "weight matrix)")
        if mode == "native":
            kernel, why = _few_rows_kernel()
            _STATE.few_rows = kernel
            _STATE.reason = f"{why}; more rows: {_STATE.reason}"
    _STATE.weights.clear()
    return _STATE.reason


def _few_rows_kernel() -> tuple[ctypes._CFuncPtr | None, str]:
    """The C++ few-row kernel, built (or loaded) and probed against F.linear, and why it serves
    or not."""
    try:
        fn = load(SOURCE, BUILD_BUDGET_S).gangserve_few_rows_linear
    except BuildFailed as exc:
        return None, f"1-{FEW_ROWS} rows: oneDNN too, the C++ kernel is unavailable ({exc})"
    fn.restype = ctypes.c_int
    fn.argtypes = [*[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 3, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    generator = torch.Generator().manual_seed(0)
    probes: tuple[tuple[int, tuple[int, int], Activation, str | None, int], ...] = (
        (1, (48, 33), "identity", None, 0), (2, (33, 48), "gelu", "layer", 0), (1, (40, 24), "relu", "rms", 0),
        (2, (32, 24), "identity", "rms", 8))
    for rows, (out_f, in_f), activation, kind, head_dim in probes:
        w, b, x = (torch.randn(out_f, in_f, generator=generator), torch.randn(out_f, generator=generator),
                   torch.randn(rows, in_f, generator=generator))
        norm = None if kind is None else RowNorm(kind, torch.randn(in_f, generator=generator),  # type: ignore[arg-type]
                                                 torch.randn(in_f, generator=generator) if kind == "layer" else None,
                                                 1e-5)
        angles = torch.randn(rows, 1, head_dim, generator=generator)
        rotary = Rotary(angles.cos(), angles.sin(), head_dim) if head_dim else None
        want = _TORCH_OPS[activation](F.linear(x if norm is None else norm.apply(x), w, b))
        want = want if rotary is None else rotary.apply(want)
        got = torch.empty(rows, out_f)
        failed = fn(x.data_ptr(), w.data_ptr(), b.data_ptr(), got.data_ptr(), rows, in_f, out_f, 1,
                    _KERNEL_CODES[activation], *(_NO_NORM_ARGS if norm is None else norm.kernel_args()),
                    *(_NO_ROTARY_ARGS if rotary is None else rotary.kernel_args(rows) or _NO_ROTARY_ARGS))
        error = float((got - want).abs().max() / want.abs().max())
        if failed or not error <= _PROBE_TOLERANCE:
            return None, (f"1-{FEW_ROWS} rows: oneDNN too, the C++ kernel disagreed with F.linear on a probe "
                          f"({rows} x {in_f} @ {in_f} x {out_f}, {activation}, {kind or 'no'} norm, rotary heads of "
                          f"{head_dim or '-'}: relative error "
                          f"{error:.2e}, status {failed})")
    return fn, f"1-{FEW_ROWS} rows: the C++ kernel over the dense weights (gemv.cpp)"


def chosen() -> str:
    """Which matmul CPU float32 weights use in this process, and why (after `configure` or the
    first call; "not decided" before)."""
    return _STATE.reason


def _onednn_problem() -> str | None:
    """Why oneDNN's packed matmul cannot serve here (None: it can): its ops, then a probe of a
    few shapes against F.linear."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN (mkldnn): torch's BLAS (F.linear)"
    try:
        reorder, matmul = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for rows, (out_f, in_f), activation in ((1, (48, 32), "identity"), (5, (32, 48), "gelu"),
                                                    (70, (40, 24), "relu")):
                w = torch.randn(out_f, in_f, generator=generator)
                b = torch.randn(out_f, generator=generator)
                x = torch.randn(rows, in_f, generator=generator)
                want = _TORCH_OPS[activation](F.linear(x, w, b))
                got = matmul(x, reorder(w), b, _POST_OPS[activation][0], [], _POST_OPS[activation][1])
                error = float((got - want).abs().max() / want.abs().max())
                if tuple(got.shape) != tuple(want.shape) or not error <= _PROBE_TOLERANCE:
                    return (f"oneDNN's packed matmul disagreed with F.linear on a probe ({rows} x {in_f} @ "
                            f"{in_f} x {out_f}, {activation}: relative error {error:.2e}, shape "
                            f"{tuple(got.shape)}): torch's BLAS")
    except Exception as exc:  # noqa: BLE001 - any failure of private ops means: not here
        return f"oneDNN's packed matmul is unavailable ({type(exc).__name__}: {str(exc)[:160]}): torch's BLAS"
    return None


def _cpu_float32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A product this module computes (else F.linear): CPU float32 without autograd."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and x.dtype == torch.float32
            and not weight.requires_grad and not x.requires_grad and weight.dim() == 2)


def _takes_few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the C++ few-row kernel computes this product (this process's choice, made on the
    first CPU float32 call if `configure` was not called; at most FEW_ROWS rows; contiguous
    weight and bias)."""
    if not _cpu_float32(x, weight):
        return False
    if _STATE.enabled is None:
        configure()
        log.info("float32 matmuls on CPU: %s", _STATE.reason)
    return (_STATE.few_rows is not None and x.numel() <= FEW_ROWS * x.shape[-1] and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def prenormed(x: torch.Tensor, norm: RowNorm, weight: torch.Tensor) -> tuple[torch.Tensor, RowNorm | None]:
    """x for the matmuls by `weight`-like matrices that read norm(x): (x, norm) where the few-row
    kernel will normalize x's rows itself (pass the norm on to `linear`), else (norm(x), None),
    computed once here for every matmul that reads it."""
    if _takes_few_rows(x, weight, None) and norm.kernel_reads():
        return x, norm
    return norm.apply(x), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: Activation = "identity", norm: RowNorm | None = None,
           rotary: Rotary | None = None) -> torch.Tensor:
    """rotary(act(norm(x) [..., in] @ weight [out, in]^T + bias [out])) -> [..., out] (see the
    module docstring; `norm`, `rotary` None: none)."""
    if _takes_few_rows(x, weight, bias) and (norm is None or norm.kernel_reads()):
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        rotary_args = _NO_ROTARY_ARGS if rotary is None else rotary.kernel_args(rows.shape[0])
        if rotary_args is not None:
            return _few_rows(rows, weight, bias, activation, norm, rotary_args).view(*x.shape[:-1], weight.shape[0])
    if norm is not None:
        x = norm.apply(x)
    if not _cpu_float32(x, weight) or not _STATE.enabled:
        y = _TORCH_OPS[activation](F.linear(x, weight, bias))
    else:
        post_op, algorithm = _POST_OPS[activation]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), _packed(weight), bias, post_op, [],
                                               algorithm).view(*x.shape[:-1], weight.shape[0])
    return y if rotary is None else rotary.apply(y)


def _few_rows(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: Activation,
              norm: RowNorm | None, rotary_args: tuple[int, int, int]) -> torch.Tensor:
    """rotary(act(norm(rows) [R <= FEW_ROWS, in] @ weight [out, in]^T + bias)) through the C++ kernel."""
    assert _STATE.few_rows is not None
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    if rows.shape[0] == 0:
        return out
    failed = _STATE.few_rows(rows.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                             out.data_ptr(), rows.shape[0], rows.shape[1], weight.shape[0], torch.get_num_threads(),
                             _KERNEL_CODES[activation], *(_NO_NORM_ARGS if norm is None else norm.kernel_args()),
                             *rotary_args)
    if failed:
        raise ValueError(f"the few-row kernel refused {tuple(rows.shape)} @ {tuple(weight.shape)}^T ({activation}, "
                         f"{'no norm' if norm is None else norm.kind + ' norm'}, rotary heads of {rotary_args[2]})")
    return out


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered for oneDNN, made again when the weight changed since (a swap copies
    into it in place, bumping its version) or its storage was replaced."""
    stamp = (weight.data_ptr(), weight._version)
    key = id(weight)
    held = _STATE.weights.get(key)
    if held is not None and held[0]() is weight and held[1] == stamp:
        return held[2]
    with torch.inference_mode():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    if held is None or held[0]() is not weight:
        weakref.finalize(weight, _STATE.weights.pop, key, None)
    _STATE.weights[key] = (weakref.ref(weight), stamp, packed)
    return packed
