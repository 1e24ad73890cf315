"""A CUDA rank's in-place session attention (service.parallel.paged_varlen): varlen_attn over the
pool's pages. This machine has no GPU, so what runs here is what a CPU can check: where the path
applies and the reason named where it does not, the arguments a step passes the kernel (through
FlashAttention's documented paged varlen semantics, written out below in float64, against dense
causal attention over each session's own sequence), and a kernel that refuses its warm-up step
leaving the gather path. The kernel itself on a GPU: bench/gpu_check.sh, tier A ("paged
varlen": the warm-up check, parity against float64, the decode step against the gather path)."""
from __future__ import annotations

import pytest
import torch

import service.parallel.kv_cache as kv_cache
from service.parallel.kv_cache import AppendPlan, warm_varlen
from service.parallel.paged_varlen import VarlenArgs, VarlenAttention, varlen_problem

pytestmark = pytest.mark.unit

CUDA = torch.device("cuda", 0)  # a device object only: nothing here initializes CUDA


def test_the_path_applies_to_cuda_in_bf16_or_fp16_with_pages_of_256_and_says_why_not_elsewhere() -> None:
    assert varlen_problem(CUDA, torch.bfloat16, 256) is None
    assert varlen_problem(CUDA, torch.float16, 512) is None
    assert varlen_problem(torch.device("cpu"), torch.bfloat16, 256) == "varlen_attn runs on CUDA only, this rank is on cpu"
    assert varlen_problem(CUDA, torch.float32, 256) == (
        "varlen_attn (FlashAttention) takes bfloat16 or float16, the compute dtype is float32")
    assert varlen_problem(CUDA, torch.bfloat16, 16) == (
        "varlen_attn reads a paged K/V in pages of a multiple of 256 positions, session_block_tokens is 16")


def _varlen_reference(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, args: VarlenArgs,
                      scale: float) -> torch.Tensor:
    """FlashAttention's paged varlen forward as documented (torch.nn.attention.varlen.varlen_attn,
    window (-1, 0)), in float64, one loop per sequence: sequence i's query rows are
    q[cu_seq_q[i] : cu_seq_q[i+1]] (n of them), its keys the first seqused_k[i] = L positions of
    its pages block_table[i] laid end to end, and causal attention aligned at the bottom right
    (window (-1, 0)): query row j attends keys 0 .. L - n + j; with no window, (-1, -1), every
    key. Query head h reads K/V head h // (heads / kv heads)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    _, page, kv, d = pool_k.shape
    h = q.shape[1]
    for i in range(args.cu_seq_q.numel() - 1):
        lo, hi, length = int(args.cu_seq_q[i]), int(args.cu_seq_q[i + 1]), int(args.seqused_k[i])
        pages = args.block_table[i, :-(-length // page)].long()
        keys = pool_k[pages].reshape(-1, kv, d)[:length].double().repeat_interleave(h // kv, dim=1)  # [L, h, d]
        values = pool_v[pages].reshape(-1, kv, d)[:length].double().repeat_interleave(h // kv, dim=1)
        n = hi - lo
        for j in range(n):
            last = length if args.window == (-1, -1) else length - n + j + 1
            scores = torch.einsum("hd,lhd->hl", q[lo + j].double(), keys[:last]) * scale
            out[lo + j] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values[:last])
    return out


DECODE_PLAN = AppendPlan(16, 4, (1, 1, 1), (0, 9, 6), ((3,), (7, 0, 12), (2, 15)))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["4-heads", "4-over-2-kv-heads"])
@pytest.mark.parametrize("plan", [
    AppendPlan(16, 4, (1, 1, 5, 6), (0, 9, 6, 0), ((3,), (7, 0, 12), (2, 15, 9), (5, 11))), DECODE_PLAN],
    ids=["mixed", "decode-only"])
def test_a_steps_arguments_make_each_row_attend_its_own_sessions_positions_up_to_itself(
        heads: tuple[int, int], plan: AppendPlan) -> None:
    """Decode rows of uneven lengths, a chunk after cached positions crossing a page, a prefill
    from nothing, pages out of order; and a step of one-row appends only, which passes no window:
    through the arguments `VarlenArgs.of` builds, each new row at position c + j equals row c + j
    of dense causal attention over its session's sequence (torch's SDPA, float64, over the
    session's K/V laid out in order: an independent layout)."""
    q_heads, kv_heads = heads
    page, d, scale = 4, 8, 8 ** -0.5
    gen = torch.Generator().manual_seed(0)
    plan.check()
    sequences = [torch.randn(c + n, 2, kv_heads, d, generator=gen, dtype=torch.float64)
                 for n, c in zip(plan.new_rows, plan.cached)]  # each session's K and V in order
    pool_k = torch.zeros(16, page, kv_heads, d, dtype=torch.float64)
    pool_v = torch.zeros_like(pool_k)
    for seq, table in zip(sequences, plan.tables):
        for p in range(seq.shape[0]):
            pool_k[table[p // page], p % page], pool_v[table[p // page], p % page] = seq[p, 0], seq[p, 1]
    q = torch.randn(plan.rows, q_heads, d, generator=gen, dtype=torch.float64)

    args = VarlenArgs.of(plan.new_rows, plan.cached, plan.tables, torch.device("cpu"))
    assert args.block_table.dtype == args.cu_seq_q.dtype == args.seqused_k.dtype == torch.int32  # the kernel's
    assert (args.max_q, args.max_k, args.window) == ((6, 11, (-1, 0)) if plan is not DECODE_PLAN else (1, 10, (-1, -1)))
    got = _varlen_reference(q, pool_k, pool_v, args, scale)

    at = 0
    for seq, n, c in zip(sequences, plan.new_rows, plan.cached):
        keys = seq[:, 0].transpose(0, 1).repeat_interleave(q_heads // kv_heads, dim=0)  # [h, L, d]
        values = seq[:, 1].transpose(0, 1).repeat_interleave(q_heads // kv_heads, dim=0)
        queries = torch.zeros(q_heads, c + n, d, dtype=torch.float64)
        queries[:, c:] = q[at:at + n].transpose(0, 1)
        dense = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
        torch.testing.assert_close(got[at:at + n], dense[:, c:].transpose(0, 1), rtol=1e-12, atol=1e-12)
        at += n


def test_a_kernel_that_refuses_its_warm_up_step_leaves_the_gather_path_and_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the device, dtype and page checks, the real varlen_attn is called on the warm-up step;
    a kernel that raises (here: torch's CPU build has no FlashAttention) gives the gather path
    with the kernel's own words, as a GPU whose FlashAttention refuses would."""
    kernel = VarlenAttention(5, 256, 4, 2, 64, torch.bfloat16)
    status = warm_varlen(kernel, torch.device("cpu"), 64 ** -0.5)
    assert (status.path, status.reason) == ("gather", "varlen_attn runs on CUDA only, this rank is on cpu")
    monkeypatch.setattr(kv_cache, "varlen_problem", lambda device, dtype, block_size: None)
    status = warm_varlen(kernel, torch.device("cpu"), 64 ** -0.5)
    assert status.path == "gather" and not status.in_place
    assert status.reason.startswith("varlen_attn failed its warm-up step (NotImplementedError: "), status.reason
    assert "_flash_attention_forward" in status.reason, status.reason
