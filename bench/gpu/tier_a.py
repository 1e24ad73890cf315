"""GPU check, tier A: torch only, one process, one GPU (no Ray).

Rows: the device; TP attention on CUDA vs the dense reference (fp32 seed weights vs
float32 nn.MultiheadAttention; bf16/fp16 random weights vs a float64 one; plain, masked,
causal, both); the 12-layer transformer stack (model=transformer) vs torch's dense
TransformerEncoder, and its step; float32 matmuls in TF32 (the `allow_tf32` builder
argument) against IEEE float32, error and time; the SDPA backends each case can use;
CUDA-event timings of the copies in and out (pageable vs pinned), the step and a batch
sweep; the real rank's root_step at world size 1 (pinned staging; the shortest path, no step clock);
a real NCCL process group of world size 1 (init, all_reduce, broadcast); the caching
allocator's reserve over 200 mixed shapes with and without expandable segments (each in
its own process, since the allocator reads its setting once); the decode step against the
memory floor (bench/decode.py's in-process rows: both stacks, S = 1, 8, 32 at context 2048);
a CUDA rank's in-place session attention (varlen_attn over the pool's pages): its warm-up
check, parity against float64, its decode step against the gather path.

GPU_CHECK_DRY_RUN=1 runs the parts that run on a CPU (parity, the stack, the rank's
root_step, the world-size-1 group on gloo) there and prints one row for each CUDA-only
part: it checks this script, not the GPU.

    python bench/gpu/tier_a.py            # prints rows; exit 0 (a failed part is a row)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from common import ROOT, cuda_event_ms, exit_text, row, section, wall_ms  # noqa: E402  (sets sys.path)

import numpy as np
import torch
import torch.nn.functional as F

E, H = 512, 8
DRY_RUN = os.environ.get("GPU_CHECK_DRY_RUN") == "1"
DEV = torch.device("cpu" if DRY_RUN else "cuda")
# The models issue's stack (model=transformer): 12 layers at the notes' width.
STACK = {"kind": "transformer", "num_layers": 12, "embed_dim": E, "num_heads": H, "ffn_dim": 4 * E}
MIXED_S = 40  # one mixed-shape run (a fresh process, its CUDA context, 200 shapes): seconds on an H200
CASES = {"plain": (False, False), "masked": (True, False), "causal": (False, True), "masked+causal": (True, True)}


def _mask(batch: int, seq: int) -> torch.Tensor:
    mask = torch.ones(batch, seq, dtype=torch.bool)
    for b in range(batch):
        mask[b, : b % 3] = False  # left padding of 0, 1, 2 tokens
        mask[b, seq - (b % 2) * 3:] = False  # and right padding in odd rows
    return mask


def parity() -> None:
    from harness.reference import dense_attention_masked, relative_error
    from service.parallel import ParallelGroup, TensorParallelAttention
    from service.parallel.weights import random_weights, seed_weights, shard_dense

    dev = DEV
    group = ParallelGroup.single(dev)
    x = torch.randn(4, 24, E, generator=torch.Generator().manual_seed(1))
    mask = _mask(4, 24)
    for dtype, init in ((torch.float32, "seed"), (torch.bfloat16, "random"), (torch.float16, "random")):
        weights = seed_weights(E) if init == "seed" else random_weights(E, 7)
        model = TensorParallelAttention(E, H, group, dtype=dtype)
        model.load_shard(shard_dense(weights, 0, 1))
        for name, (masked, causal) in CASES.items():
            with section(f"parity {dtype} {init} {name}"):
                km = mask.to(dev) if masked else None
                with torch.inference_mode():
                    got = model(x.to(dev, dtype), km, causal) if (masked or causal) else model(x.to(dev, dtype))
                ref_dtype = torch.float32 if init == "seed" else torch.float64  # seed: as the CPU tests
                want = dense_attention_masked({k: v.to(ref_dtype) for k, v in weights.items()}, H, x.to(ref_dtype),
                                              mask.int() if masked else None, causal)
                err = relative_error(got.float().cpu(), want)
                finite = bool(torch.isfinite(got).all())
                row(f"rel err vs dense, {str(dtype)[6:]} {init}, {name}", f"{err:.2e}{'' if finite else ' NON-FINITE'}")


def sdpa_backends() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from service.parallel.layers import sdpa_mask

    dev = torch.device("cuda")
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q = torch.randn(8, H, 128, E // H, device=dev, dtype=dtype)
        mask = _mask(8, 128).to(dev)
        for name, (masked, causal) in CASES.items():
            ok = []
            for b in backends:
                try:
                    with sdpa_kernel([b]):
                        if masked:
                            F.scaled_dot_product_attention(q, q, q, attn_mask=sdpa_mask(mask, causal, dtype))
                        else:
                            F.scaled_dot_product_attention(q, q, q, is_causal=causal)
                    ok.append(b.name)
                except RuntimeError:
                    pass
            # The dispatcher takes the first that works in its priority order (flash, efficient, cudnn, math).
            row(f"SDPA backends usable, {str(dtype)[6:]} {name}", ", ".join(ok) or "none")


def copies_and_step() -> None:
    from service.parallel import ParallelGroup, TensorParallelAttention
    from service.parallel.weights import seed_weights, shard_dense

    dev = torch.device("cuda")
    x = torch.randn(128, 8, E)  # the notes' shape, 2 MiB
    pageable, pinned = x.clone(), x.clone().pin_memory()
    xd = x.to(dev)
    out_pageable, out_pinned = torch.empty_like(x), torch.empty_like(x).pin_memory()
    row("H2D 2 MiB pageable, ms", f"{cuda_event_ms(lambda: pageable.to(dev)):.3f}")
    row("H2D 2 MiB pinned (non_blocking), ms", f"{cuda_event_ms(lambda: pinned.to(dev, non_blocking=True)):.3f}")
    row("D2H 2 MiB pageable, ms", f"{cuda_event_ms(lambda: out_pageable.copy_(xd)):.3f}")
    row("D2H 2 MiB pinned (non_blocking), ms", f"{cuda_event_ms(lambda: out_pinned.copy_(xd, non_blocking=True)):.3f}")
    model = TensorParallelAttention(E, H, ParallelGroup.single(dev))
    model.load_shard(shard_dense(seed_weights(E), 0, 1))
    mask = _mask(128, 8).to(dev)
    with torch.inference_mode():
        row("step (TP forward, ws1) 128x8x512 fp32, ms", f"{cuda_event_ms(lambda: model(xd)):.3f}")
        row("step masked+causal 128x8x512 fp32, ms", f"{cuda_event_ms(lambda: model(xd, mask, True)):.3f}")
        for batch in (1, 8, 32, 128, 512):
            xb = torch.randn(batch, 8, E, device=dev)
            row(f"step batch sweep [{batch}, 8, 512] fp32, ms", f"{cuda_event_ms(lambda: model(xb)):.3f}")
        bf = TensorParallelAttention(E, H, ParallelGroup.single(dev), dtype=torch.bfloat16)
        from service.parallel.weights import random_weights

        bf.load_shard(shard_dense(random_weights(E, 7), 0, 1))
        xbf = xd.to(torch.bfloat16)
        row("step 128x8x512 bf16, ms", f"{cuda_event_ms(lambda: bf(xbf)):.3f}")


def rank_root_step() -> None:
    """The real rank (service.gang.worker.Rank) at world size 1 on CUDA (the CPU in the dry run)."""
    from service.gang.steps import Forward
    from service.gang.worker import PlainModel, Rank

    rank = Rank(0, 1, device=torch.device(DEV.type, 0), node_ip="127.0.0.1", device_how="tier A")
    rank.rendezvous("127.0.0.1", 0, "gloo" if DRY_RUN else "nccl", 30.0)  # world size 1: no group (see ws1_group)
    rank.load_weights(PlainModel(embed_dim=E, num_heads=H), 1)
    x = np.random.default_rng(0).standard_normal((128, 8, E)).astype(np.float32)
    mask = _mask(128, 8).numpy()
    row("rank allocator conf", rank.allocator_conf or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or "(CPU: none)")
    row("rank root_step 128x8x512 (pinned in/out, sync), wall p50 ms", f"{wall_ms(lambda: Forward(x).root(rank, 1)):.3f}")
    row("rank root_step masked 128x8x512, wall p50 ms", f"{wall_ms(lambda: Forward(x, mask).root(rank, 1)):.3f}")
    Forward(x).root(rank, 1)
    # World size 1 takes the shortest path: no step clock, two host stamps (on CUDA the compute's launch).
    row("rank ws1 step input ready->computed (host stamps: the launch on CUDA), ms",
        f"{(rank.alone_ns[1] - rank.alone_ns[0]) / 1e6:.3f}")
    small = x[:1, :1]
    row("rank root_step 1x1x512, wall p50 ms", f"{wall_ms(lambda: Forward(small).root(rank, 1)):.3f}")
    row("rank memory_stats", rank.memory_stats() or "(CPU: none)")
    rank.close()


def _stack(dtype: torch.dtype, init: str = "random", seed: int = 7) -> tuple[object, torch.nn.Module]:
    """The 12-layer stack at world size 1 on DEV, seeded, and the architecture (for its dense twin)."""
    from service.gang.worker import PlainModel
    from service.parallel import ParallelGroup
    from service.parallel.model import shard_dense
    from service.parallel.registry import resolve

    arch = resolve(PlainModel(**STACK))
    model = arch.build(ParallelGroup.single(DEV), dtype)
    model.load_shard(shard_dense(arch, arch.init_weights(init, seed), 0, 1))
    return arch, model.eval()


def stack() -> None:
    """model=transformer, 12 layers: parity with torch's dense TransformerEncoder (float64),
    per dtype and mask case, and the step's time."""
    from harness.reference import relative_error

    arch, model = _stack(torch.float32)
    dense = arch.dense_module().double().eval()  # type: ignore[attr-defined]
    dense.load_state_dict({k: v.double() for k, v in arch.init_weights("random", 7).items()}, strict=True)  # type: ignore[attr-defined]
    x = torch.randn(4, 24, E, generator=torch.Generator().manual_seed(1))
    mask = _mask(4, 24)
    # The dry run checks the script: two dtypes, the two extreme cases (a 12-layer float64
    # reference per case costs seconds on a busy CPU).
    dtypes = (torch.float32, torch.bfloat16) if DRY_RUN else (torch.float32, torch.bfloat16, torch.float16)
    cases = {k: CASES[k] for k in ("plain", "masked+causal")} if DRY_RUN else CASES
    shape = (4, 24) if DRY_RUN else (128, 8)
    for dtype in dtypes:
        if dtype != torch.float32:
            _, model = _stack(dtype)
        for name, (masked, causal) in cases.items():
            with section(f"stack {dtype} {name}"), torch.inference_mode():
                km = mask.to(DEV) if masked else None
                got = model(x.to(DEV, dtype), km, causal)
                want = arch.dense_forward(dense, x.double(), mask if masked else None, causal)  # type: ignore[attr-defined]
                finite = bool(torch.isfinite(got).all())
                row(f"12-layer stack rel err vs dense float64, {str(dtype)[6:]}, {name}",
                    f"{relative_error(got.float().cpu(), want):.2e}{'' if finite else ' NON-FINITE'}")
        if dtype == torch.float16:
            continue
        xd = torch.randn(*shape, E, device=DEV, dtype=dtype)
        with torch.inference_mode():
            ms = wall_ms(lambda: model(xd), n=3, warmup=1) if DRY_RUN else cuda_event_ms(lambda: model(xd), n=20)
        row(f"12-layer stack step {shape[0]}x{shape[1]}x{E} {str(dtype)[6:]}, ms", f"{ms:.3f}")


def tf32() -> None:
    """float32 with TF32 matmuls (builder argument allow_tf32) against IEEE float32: the error
    it costs against float64 and the time it saves, for the attention layer and the stack."""
    from harness.reference import dense_attention_masked, relative_error
    from service.gang.backends import set_tf32_matmuls
    from service.parallel import ParallelGroup, TensorParallelAttention
    from service.parallel.weights import random_weights, shard_dense

    weights = random_weights(E, 7)
    attn = TensorParallelAttention(E, H, ParallelGroup.single(DEV))
    attn.load_shard(shard_dense(weights, 0, 1))
    x = torch.randn(128, 8, E, generator=torch.Generator().manual_seed(1))
    want = dense_attention_masked({k: v.double() for k, v in weights.items()}, H, x.double(), None, False)
    xd = x.to(DEV)
    try:
        arch, enc = _stack(torch.float32)
        dense = arch.dense_module().double().eval()  # type: ignore[attr-defined]
        dense.load_state_dict({k: v.double() for k, v in arch.init_weights("random", 7).items()})  # type: ignore[attr-defined]
        with torch.inference_mode():
            want_stack = arch.dense_forward(dense, x.double())  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        enc = None
    try:
        for allow in (False, True):
            how = set_tf32_matmuls(allow)
            with torch.inference_mode():
                err = relative_error(attn(xd).cpu(), want)
                row(f"attention 128x8x512 float32, matmuls {how}: rel err vs float64 / step ms",
                    f"{err:.2e} / {cuda_event_ms(lambda: attn(xd)):.3f}")
                if enc is not None:
                    err = relative_error(enc(xd).cpu(), want_stack)
                    row(f"12-layer stack 128x8x512 float32, matmuls {how}: rel err vs float64 / step ms",
                        f"{err:.2e} / {cuda_event_ms(lambda: enc(xd), n=20):.3f}")
    finally:
        set_tf32_matmuls(False)


def ws1_group() -> None:
    """A real process group of world size 1 (NCCL on the GPU, gloo in the dry run), as a
    gang of one would hold: its creation (NCCL: eager, device_id) and a step's two
    collectives on the notes' 2 MiB activation. (The service's rank skips the group at
    world size 1: Rank.rendezvous; these rows say what one would cost.)"""
    import datetime

    import torch.distributed as dist

    backend = "gloo" if DRY_RUN else "nccl"
    started = time.monotonic()
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30),
                            device_id=DEV if backend == "nccl" else None)
    try:
        t = torch.randn(128, 8, E, device=DEV)
        dist.all_reduce(t)  # the first collective (NCCL: its kernels load)
        row(f"ws1 {backend} group: init + first all_reduce, s", f"{time.monotonic() - started:.2f}")
        timer = (lambda f: wall_ms(f, n=30)) if DRY_RUN else cuda_event_ms
        row(f"ws1 {backend} all_reduce 2 MiB, ms", f"{timer(lambda: dist.all_reduce(t)):.3f}")
        row(f"ws1 {backend} broadcast 2 MiB, ms", f"{timer(lambda: dist.broadcast(t, src=0)):.3f}")
    finally:
        dist.destroy_process_group()


MIXED = r"""
import random, torch, sys
sys.path[:0] = [sys.argv[1]]
from service.parallel import ParallelGroup, TensorParallelAttention
from service.parallel.weights import random_weights, shard_dense
dev = torch.device("cuda")
m = TensorParallelAttention(512, 8, ParallelGroup.single(dev))
m.load_shard(shard_dense(random_weights(512, 1), 0, 1))
rng = random.Random(0)
with torch.inference_mode():
    for i in range(200):
        b, s = rng.randint(1, 64), rng.randint(1, 512)
        x = torch.randn(b, s, 512, device=dev)
        km = torch.rand(b, s, device=dev) > 0.1 if i % 2 else None
        m(x, km, bool(i % 3 == 0)) if km is not None else m(x)
torch.cuda.synchronize()
print(torch.cuda.max_memory_reserved() >> 20, torch.cuda.memory_reserved() >> 20, torch.cuda.max_memory_allocated() >> 20)
"""


def mixed_shapes() -> None:
    for conf in ("", "expandable_segments:True"):
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        done = subprocess.run([sys.executable, "-c", MIXED, str(ROOT)], env=env, capture_output=True, text=True,
                              timeout=MIXED_S)
        if done.returncode != 0:
            raise RuntimeError(f"mixed-shape run ({conf or 'default'}) {exit_text(done.returncode)}: "
                               f"{done.stderr.strip().splitlines()[-1:]}")
        peak, now, alloc = done.stdout.split()
        row(f"200 mixed shapes ({conf or 'default allocator'}): max_memory_reserved / reserved / max_allocated MiB",
            f"{peak} / {now} / {alloc}")


def decode_floor() -> None:
    """The decode step against the memory floor (bench/decode.py's rows, in process): the 12-layer
    E768 stack and bench/llama.py's Llama stack at world size 1 on GPU 0, S = 1, 8, 32 one-row
    appends at context 2048 over the K/V pool (a CUDA rank's path: the gather), median of 10
    synchronized calls, against (W + sum KV) / B, B the bytes read plus written per second by a
    1 GiB copy_ on the GPU, measured right after each stack's rows. CUDA only: on a CPU the same
    rows are `bench/decode.py --in-process` (two stack builds would cost tier A's dry run 20 s
    on a busy machine); tests/test_gpu_check.py imports bench.decode on the simulated image."""
    from bench.decode import in_process_steps

    for dtype in (torch.float32, torch.bfloat16):
        for stack in ("transformer", "llama"):
            with section(f"decode floor {stack} {dtype}"):
                for r in in_process_steps(stack, (1, 8, 32), 2048, DEV, dtype, repeats=10):
                    row(f"decode step {stack} ws1 S={r.sessions} ctx 2048 {str(dtype)[6:]}: step ms / floor ms "
                        "(W MB + sum KV MB at B GB/s)",
                        f"{r.compute_ms:.3f} / {r.floor_ms:.3f} = {r.ratio:.2f} ({r.weight_bytes_per_rank / 1e6:.0f} + "
                        f"{r.kv_bytes_per_rank / 1e6:.0f} at {r.bandwidth_gbs:.0f})")
            torch.cuda.empty_cache()


def _dense_causal_tail(keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 reference: the last n rows of causal attention over one session's L positions,
    q [n, h, d] (at positions L - n .. L - 1), keys/values [L, kv, d] -> [n, h, d]."""
    n, h, _ = q.shape
    length, kv = keys.shape[0], keys.shape[1]
    k = keys.double().transpose(0, 1).repeat_interleave(h // kv, dim=0)  # [h, L, d]
    v = values.double().transpose(0, 1).repeat_interleave(h // kv, dim=0)
    allowed = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]  # [n, L]
    return F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=allowed.to(k.device),
                                          scale=scale).transpose(0, 1)


def paged_varlen() -> None:
    """A CUDA rank's in-place session attention (service.parallel.paged_varlen: varlen_attn over
    the pool's pages): the rank's warm-up check, then parity against float64 dense causal
    attention for a step of decode rows and chunks (pages out of order, grouped-query heads too),
    then the decode step of both stacks in bf16 at pages of 256, gather vs varlen, same run."""
    from bench.decode import in_process_steps
    from service.parallel.kv_cache import AppendPlan, PagedKVPool, paged_attention, warm_varlen
    from service.parallel.paged_varlen import VarlenAttention

    b, d, scale = 256, 64, 64 ** -0.5
    gen = torch.Generator().manual_seed(3)
    plan = AppendPlan(12, b, (1, 1, 7, 300), (0, 700, 2 * b - 3, 100),
                      ((5,), (9, 2, 11), (0, 7, 3), (1, 4)))
    for dtype in (torch.bfloat16, torch.float16):
        for q_heads, kv_heads in ((12, 12), (16, 4)):
            name = f"{str(dtype)[6:]} {q_heads} query heads over {kv_heads} K/V"
            kernel = VarlenAttention(12, b, q_heads, kv_heads, d, dtype)
            status = warm_varlen(kernel, DEV, scale)
            row(f"paged varlen warm-up, {name}", f"{status.path} ({status.reason}; {status.compile_s:.3f} s)")
            if status.path != "varlen":
                continue
            pool = PagedKVPool(12, b, kv_heads, d, dtype, DEV)
            pool.k.normal_()
            pool.v.normal_()
            pool.attention = kernel
            q = torch.randn(plan.rows, q_heads, d, generator=gen).to(DEV, dtype)
            k = torch.randn(plan.rows, kv_heads, d, generator=gen).to(DEV, dtype)
            v = torch.randn(plan.rows, kv_heads, d, generator=gen).to(DEV, dtype)
            with torch.inference_mode():
                got = paged_attention(pool, 0, q, k, v, plan, scale).double()
            worst, at = 0.0, 0
            for n, c, table in zip(plan.new_rows, plan.cached, plan.tables):
                ids = torch.tensor(table, device=DEV)
                keys = pool.k[0][ids].reshape(-1, kv_heads, d)[:c + n]
                values = pool.v[0][ids].reshape(-1, kv_heads, d)[:c + n]
                want = _dense_causal_tail(keys, values, q[at:at + n], scale)
                worst = max(worst, float((got[at:at + n] - want).abs().max() / want.abs().max()))
                at += n
            row(f"paged varlen vs float64 dense causal, {name}: max |difference| / max |output|", f"{worst:.2e}")
    for stack in ("transformer", "llama"):
        with section(f"decode {stack} bf16, pages of 256: gather vs varlen"):
            for varlen in (False, True):
                for r in in_process_steps(stack, (1, 8, 32), 2048, DEV, torch.bfloat16, repeats=10, block=256,
                                          varlen=varlen):
                    row(f"decode step {stack} ws1 S={r.sessions} ctx 2048 bf16 pages 256 ({r.where}): step ms / "
                        "floor ms", f"{r.compute_ms:.3f} / {r.floor_ms:.3f} = {r.ratio:.2f}")
        torch.cuda.empty_cache()


# (name, part, runs on a CPU): the dry run runs the parts that do, and says which it skipped.
PARTS = (("parity", parity, True), ("12-layer stack", stack, True), ("tf32", tf32, False),
         ("sdpa backends", sdpa_backends, False), ("copies and step", copies_and_step, False),
         ("rank root_step", rank_root_step, True), ("ws1 group", ws1_group, True), ("mixed shapes", mixed_shapes, False),
         ("decode floor", decode_floor, False), ("paged varlen", paged_varlen, False))


def main() -> int:
    if DRY_RUN:
        row("tier A", f"DRY RUN on the CPU (torch {torch.__version__}): checks the script, not the GPU")
    elif not torch.cuda.is_available():
        row("tier A", f"no CUDA: tier skipped (torch {torch.__version__}, cuda {torch.version.cuda})")
        return 0
    else:
        props = torch.cuda.get_device_properties(0)
        row("device", f"{props.name}, {props.total_memory >> 30} GiB, sm_{props.major}{props.minor}")
        row("torch / CUDA / NCCL", f"{torch.__version__} / {torch.version.cuda} / "
                                   f"{'.'.join(map(str, torch.cuda.nccl.version()))}")
    for name, fn, on_cpu in PARTS:
        if DRY_RUN and not on_cpu:
            row(name, "CUDA only: not run in the dry run")
            continue
        with section(name):
            fn()
    return 0


if __name__ == "__main__":
    sys.exit(main())
