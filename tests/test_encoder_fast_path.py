"""A world-size-1 `model=transformer` stack runs torch's fused encoder kernel where the fast path's
conditions hold (service.parallel.transformer.FusedEncoder), op by op where they do not, and both
paths give torch's own float64 `nn.TransformerEncoder` within the models' tolerance.

A rank that holds the whole layer needs no process group (`ParallelGroup.single`), so these run
in the test process. Which path ran is told by the bits: the fused kernel and the op-by-op layers
round differently, so their outputs differ while each stays within the tolerance of the
reference; where the fused path does not apply, switching torch's fast path off changes nothing.
"""
from __future__ import annotations

import pytest
import torch

from service.parallel.group import ParallelGroup
from service.parallel.transformer import FusedEncoder, ParallelEncoder, TransformerDef
from tests.reference import STACKS, TOL, relative_error, torch_encoder, torch_reference

pytestmark = pytest.mark.unit

ODD_HEADS = TransformerDef(2, 60, 3, 96, "relu", False)  # torch's fast path needs an even head count


def _stack(arch: TransformerDef) -> tuple[ParallelEncoder, torch.nn.TransformerEncoder]:
    """The world-size-1 stack and torch's float64 module, holding the same weights."""
    weights = arch.init_weights("random", 5)
    model = arch.build(ParallelGroup.single(), torch.float32)
    model.load_shard(weights)
    return model, torch_encoder(arch, weights)


def _tokens(case: str) -> torch.Tensor | None:
    """[3, 9] bool (True = token): none, right padding, or holes with one row all padding."""
    if case == "plain":
        return None
    tokens = torch.ones(3, 9, dtype=torch.bool)
    if case == "right":
        tokens[1, 6:] = False
        tokens[2, 2:] = False
    else:  # holes, and a row with no token at all (its output is all 0); no row starts padded:
        tokens[0, 3:5] = False  # torch's causal module gives such a row NaN everywhere
        tokens[1, 1::2] = False
        tokens[2] = False
    return tokens


def _run(model: ParallelEncoder, x: torch.Tensor, tokens: torch.Tensor | None, causal: bool,
         fast_path: bool) -> torch.Tensor:
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fast_path)
    try:
        with torch.inference_mode():
            return model(x, tokens, causal)
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("case", ["plain", "right", "holes"])
@pytest.mark.parametrize("causal", [False, True])
def test_both_paths_equal_torch_float64_and_the_fused_one_runs_where_it_applies(stack: str, case: str,
                                                                                causal: bool) -> None:
    arch = STACKS[stack]
    model, reference = _stack(arch)
    x = torch.randn(3, 9, arch.embed_dim, generator=torch.Generator().manual_seed(3))
    tokens = _tokens(case)
    keep = tokens if tokens is not None else torch.ones(3, 9, dtype=torch.bool)
    want = torch_reference(reference, x, tokens, causal)
    fused = _run(model, x, tokens, causal, fast_path=True)
    op_by_op = _run(model, x, tokens, causal, fast_path=False)
    for got in (fused, op_by_op):
        assert relative_error(got[keep], want[keep]) <= TOL
        if tokens is not None:
            assert torch.count_nonzero(got[~tokens]) == 0  # padded rows have no output
    with torch.inference_mode():
        applies = model.fused_path.applies(x, causal)
    assert applies is (not causal)  # causal requests keep the op-by-op path
    assert torch.equal(fused, op_by_op) is (not applies)  # a different kernel ran exactly where it applies


def test_the_fused_path_needs_whole_layers_no_autograd_and_an_even_head_count() -> None:
    model, reference = _stack(ODD_HEADS)
    x = torch.randn(2, 5, ODD_HEADS.embed_dim, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert not model.fused_path.applies(x, False)
    got = _run(model, x, None, False, fast_path=True)
    assert torch.equal(got, _run(model, x, None, False, fast_path=False))
    assert relative_error(got, torch_reference(reference, x, None, False)) <= TOL

    even, _ = _stack(STACKS["post-relu"])
    x = torch.randn(2, 5, STACKS["post-relu"].embed_dim)
    assert not even.fused_path.applies(x, False)  # autograd on: the kernel has no backward
    with torch.inference_mode():
        assert even.fused_path.applies(x, False)
    assert FusedEncoder.of(STACKS["post-relu"], ParallelGroup.single()).whole_layers
