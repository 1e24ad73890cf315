"""Levers measured without the service (bench/NOTES.md records the results):

- `qkv`: three q/k/v projections [N, E] x [E/p, E]^T per rank against one fused [3E/p, E];
- `heap`: copying a [128, 8, 512] float32 output out of a shared region and npy-encoding it,
  with glibc's default malloc thresholds and with service.cluster.heap's (each in its own
  process: the thresholds are process-wide);
- `encoder`: the 12-layer E=768 stack at world size 1 (2 threads) through torch's fused encoder
  kernel and op by op (torch's fast-path switch), beside torch's own nn.TransformerEncoder
  holding the same weights, interleaved, [1, 128, 768] and [4, 128, 768];
- `hops`: what one wake costs on this machine: an asyncio timer armed and cancelled,
  `asyncio.to_thread` of a no-op, a thread's `call_soon_threadsafe` back to the loop;
- `batcher`: a lone request through the StepBatcher (inline at once) against the queued path it
  took before when `batch_wait_timeout_s` > 0 (a drainer task and the linger), trivial step;
- `decode`: a decode step's attention alone (`paged_attention` over 12 layers of the 12-layer
  E768 stack's pool at world size 1, 12 heads of 64, 16-token pages scattered, every session at
  context 2048, one new row each) for S sessions, interleaved: the gather path, and the compiled
  in-place kernel as before (one call of 4 or 32), now (a call per session up to
  DECODE_ALONE_UP_TO sessions, else calls padded to DECODE_BUCKETS), and a call per session always:
  where the gather and in place cross, and what batching and padding sessions in one call costs.
  `decode N [S ...]` runs it with N threads (1) and those numbers of sessions (1 2 4 8 16);
- `paged_cpp`: a candidate for the CPU decode attention, not in the service: a hand-written C++
  kernel (`_PAGED_DECODE_CPP`, built with torch's `load_inline`: one session's query heads over
  its pages where they lie, the pages split between the threads, per page each token's K row
  read once for every head's score, an online softmax per page, then each token's V row once;
  the threads' partial results merged) against the compiled flex kernel (`paged_attention` as a
  rank runs it) and the gather path, 12 layers of the 12-layer E768 pool at context 2048, one
  session; checked against the gather path first. `paged_cpp N` runs it with N threads (2);
- `warmup`: the in-place kernel's warm-up (a ws1 rank's, the 12-layer E768 stack's pool) in a
  fresh process with an empty inductor cache directory, again in a fresh process with the cache
  the first left, and a second warm-up of a new kernel in the same process (what a gang rebuild
  pays: new peer processes on the same node, rank 0's process kept).

    python bench/micro_levers.py [qkv heap encoder hops batcher decode paged_cpp warmup]   (all by default)
"""
from __future__ import annotations

import mmap
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np


def median_us(fn: Callable[[], object], calls: int = 200, rounds: int = 5) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def qkv(embed_dim: int = 512, world_size: int = 2) -> None:
    import torch
    import torch.nn.functional as F

    local = embed_dim // world_size
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in (8, 1024):
            x = torch.randn(rows, embed_dim)
            w, b = [torch.randn(local, embed_dim) for _ in range(3)], [torch.randn(local) for _ in range(3)]
            fused_w, fused_b = torch.cat(w), torch.cat(b)
            three = median_us(lambda: [F.linear(x, wi, bi) for wi, bi in zip(w, b)])
            fused = median_us(lambda: F.linear(x, fused_w, fused_b).split(local, dim=-1))
            print(f"qkv, {threads} thread(s), {rows} rows: three {three:.1f} us, fused {fused:.1f} us, "
                  f"fused/three {fused / three:.2f}")


def heap(kept: bool) -> None:
    from gangserve_client.codecs import encode_npy

    if kept:
        from service.cluster.heap import keep_freed_buffers
        keep_freed_buffers()
    region = mmap.mmap(-1, 128 * 8 * 512 * 4)
    view = np.frombuffer(region, dtype=np.float32).reshape(128, 8, 512)
    view[...] = 1.0
    ms = median_us(lambda: encode_npy(view.copy())) / 1000
    print(f"heap, {'kept' if kept else 'glibc default'}: copy out of the region + npy encode {ms:.3f} ms")


def encoder(rounds: int = 15) -> None:
    """Median and spread of `rounds` interleaved rounds (each row once per round, in a shuffled order) per shape."""
    import random

    import torch

    from service.parallel.group import ParallelGroup
    from service.parallel.transformer import TransformerDef

    torch.set_num_threads(2)
    arch = TransformerDef(12, 768, 12, 3072, "gelu", True)  # bench.run's 12-layer stack
    weights = arch.init_weights("random", 0)
    ours = arch.build(ParallelGroup.single(), torch.float32)
    ours.load_shard(weights)
    module = arch.dense_module().eval()
    module.load_state_dict(weights)

    def ours_with(fast_path: bool, x: torch.Tensor) -> Callable[[], object]:
        def call() -> object:
            torch.backends.mha.set_fastpath_enabled(fast_path)
            try:
                return ours(x)
            finally:
                torch.backends.mha.set_fastpath_enabled(True)
        return call

    order = random.Random(55)
    for batch in (1, 4):
        x = torch.randn(batch, 128, 768)
        rows = {"torch nn.TransformerEncoder": lambda: arch.dense_forward(module, x),
                "ours, fused kernel": ours_with(True, x), "ours, op by op": ours_with(False, x)}
        ms: dict[str, list[float]] = {name: [] for name in rows}
        with torch.inference_mode():
            for fn in rows.values():
                fn()
            for _ in range(rounds):
                names = list(rows)
                order.shuffle(names)
                for name in names:
                    t0 = time.perf_counter()
                    rows[name]()
                    ms[name].append((time.perf_counter() - t0) * 1000)
        base = statistics.median(ms["torch nn.TransformerEncoder"])
        for name, v in ms.items():
            v.sort()
            print(f"encoder [{batch}, 128, 768]: {name} p50 {statistics.median(v):.1f} ms "
                  f"(min {v[0]:.1f}, max {v[-1]:.1f}), / torch {statistics.median(v) / base:.3f}")


def hops() -> None:
    import asyncio
    import threading

    async def measure() -> None:
        loop = asyncio.get_running_loop()
        timer = median_us(lambda: loop.call_later(1.0, lambda: None).cancel(), calls=2000)
        samples = []
        for _ in range(300):
            t0 = time.perf_counter()
            await asyncio.to_thread(lambda: None)
            samples.append(time.perf_counter() - t0)
        to_thread = statistics.median(samples) * 1e6
        samples = []
        for _ in range(300):
            done = loop.create_future()
            t0 = time.perf_counter()
            threading.Thread(target=lambda: loop.call_soon_threadsafe(done.set_result, None)).start()
            await done
            samples.append(time.perf_counter() - t0)
        threadsafe = statistics.median(samples) * 1e6
        print(f"hops: timer armed + cancelled {timer:.1f} us; asyncio.to_thread(no-op) {to_thread:.0f} us; "
              f"a new thread's call_soon_threadsafe back to the loop {threadsafe:.0f} us (thread start included)")

    asyncio.run(measure())


def batcher(wait_s: float = 0.005) -> None:
    import asyncio

    from service.config.builder_args import BatchPolicy
    from service.gang.batching import BatchQueue, StepBatcher

    async def step(x: np.ndarray, mask: object = None, causal: object = None, deadline: object = None) -> np.ndarray:
        return x

    async def measure() -> None:
        x = np.zeros((1, 8, 512), dtype=np.float32)
        inline = StepBatcher(step, BatchPolicy(max_batch_size=64, wait_s=wait_s))
        queued = StepBatcher(step, BatchPolicy(max_batch_size=64, wait_s=wait_s))
        # The path a lone request took before: queued for the drainer, which lingers wait_s.
        queued._queue = BatchQueue(queued._take_group, queued._step, queued._queue._words,
                                   linger=lambda q: wait_s, inline_when_idle=False)
        no_linger = StepBatcher(step, BatchPolicy(max_batch_size=64))
        no_linger._queue = BatchQueue(no_linger._take_group, no_linger._step, no_linger._queue._words)
        for name, b in (("lone request now (inline at once)", inline),
                        (f"before: queued, drainer + linger {wait_s * 1000:.0f} ms", queued),
                        ("queued, drainer task, no linger (the hop alone)", no_linger)):
            samples = []
            for _ in range(200):
                t0 = time.perf_counter()
                await b.submit(x)
                samples.append(time.perf_counter() - t0)
            print(f"batcher: {name}: p50 {statistics.median(samples) * 1e6:.0f} us")

    asyncio.run(measure())


def decode(sessions: tuple[int, ...] = (1, 2, 4, 8, 16), rounds: int = 7, context: int = 2048,
           threads: int = 1) -> None:
    """Per S: the median (and min) wall ms and the median CPU ms (`time.process_time`) of
    `rounds` interleaved rounds (each variant once per round, shuffled). With one thread the CPU
    time is the work done, whatever the machine's load (a shared machine's wall time is not).
    Each call gets a plan object of its own, as a served step does (the kernel builds a step's
    block masks once per plan: `InPlaceAttention._memo`), so the masks' build is in every call.
    Session i is at context - 3 i (as served sessions, of lengths that differ: the CPU decode
    template's fast path needs every batch entry's block counts equal, service.parallel.paged_kernel)."""
    import dataclasses
    import random

    import torch

    from service.parallel.kv_cache import AppendPlan, PagedKVPool, paged_attention
    from service.parallel.paged_kernel import DECODE_ALONE_UP_TO, DECODE_BUCKETS, InPlaceAttention

    torch.set_num_threads(threads)
    block, heads, head_dim, layers = 16, 12, 64, 12
    per = -(-(context + 1) // block)
    lengths = [context - 3 * i for i in range(max(sessions))]
    num_blocks = max(sessions) * per + 64
    order = np.random.default_rng(0).permutation(num_blocks)
    tables = tuple(tuple(int(b) for b in order[i * per:i * per + -(-(lengths[i] + 1) // block)])
                   for i in range(max(sessions)))
    pool = PagedKVPool(num_blocks, block, heads, head_dim, torch.float32, torch.device("cpu"), layers=layers)
    pool.k.normal_()
    pool.v.normal_()
    scale = head_dim ** -0.5
    kernels: dict[str, InPlaceAttention | None] = {"gather": None}
    variants = {"before: calls of 4/32": ((4, 32), 0),
                f"now: alone up to {DECODE_ALONE_UP_TO}, else calls of {'/'.join(map(str, DECODE_BUCKETS[1:]))}":
                    (DECODE_BUCKETS, DECODE_ALONE_UP_TO),
                "a call per session": ((1,), 0)}
    for name, (buckets, alone) in variants.items():
        kernel = InPlaceAttention(num_blocks, block, heads, heads, head_dim, torch.float32, decode_buckets=buckets,
                                  alone_up_to=alone)
        t0 = time.perf_counter()
        with torch.inference_mode():
            kernel.warm(pool.k[0], pool.v[0], scale, budget_s=600)
        print(f"decode: {name}: warm-up {time.perf_counter() - t0:.1f} s "
              f"(shapes compiled before in this process are not compiled again)", flush=True)
        kernels[name] = kernel
    shuffle = random.Random(52)
    for s in sessions:
        plan = AppendPlan(num_blocks, block, (1,) * s, tuple(lengths[:s]), tables[:s])
        q, k, v = (torch.randn(s, heads, head_dim) for _ in range(3))

        def step(kernel: InPlaceAttention | None) -> None:
            pool.attention = kernel
            fresh = dataclasses.replace(plan)  # a served step's plan is a new object
            for layer in range(layers):
                paged_attention(pool, layer, q, k, v, fresh, scale)

        wall: dict[str, list[float]] = {name: [] for name in kernels}
        cpu: dict[str, list[float]] = {name: [] for name in kernels}
        with torch.inference_mode():
            for kernel in kernels.values():
                step(kernel)
            for _ in range(rounds):
                names = list(kernels)
                shuffle.shuffle(names)
                for name in names:
                    c0, t0 = time.process_time(), time.perf_counter()
                    step(kernels[name])
                    wall[name].append((time.perf_counter() - t0) * 1000)
                    cpu[name].append((time.process_time() - c0) * 1000)
        base = statistics.median(cpu["gather"])
        print(f"decode S={s} at {context}, {threads} thread(s), load {os.getloadavg()[0]:.1f}: " + "; ".join(
            f"{name} cpu {statistics.median(cpu[name]):.1f} ms (x{statistics.median(cpu[name]) / base:.2f}), "
            f"wall {statistics.median(wall[name]):.1f} (min {min(wall[name]):.1f})" for name in kernels), flush=True)


_PAGED_DECODE_CPP = r'''
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <algorithm>
#include <limits>

// Token-major: each token's K row (all heads, contiguous) is read once, scoring every head.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor table,
                           int64_t length, double scale_d) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "float32 q, k, v expected");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && table.is_contiguous(),
              "contiguous q, k, v and table expected");
  TORCH_CHECK(q.size(0) % k.size(2) == 0, "query heads ", q.size(0), " not a multiple of K/V heads ", k.size(2));
  const int64_t H = q.size(0), D = q.size(1), B = k.size(1), KVH = k.size(2), G = H / KVH;
  const int64_t pages = (length + B - 1) / B;
  const float* qp = q.data_ptr<float>(); const float* kp = k.data_ptr<float>(); const float* vp = v.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t page_stride = B * KVH * D, tok_stride = KVH * D;
  const float scale = (float)scale_d;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pages));
  std::vector<float> M(chunks * H, -std::numeric_limits<float>::infinity()), L(chunks * H, 0.f), ACC(chunks * H * D, 0.f);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> s(B * H), w(B * H);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t p0 = pages * c / chunks, p1 = pages * (c + 1) / chunks;
      float* m = &M[c * H]; float* l = &L[c * H]; float* acc = &ACC[c * H * D];
      for (int64_t p = p0; p < p1; ++p) {
        const float* kpage = kp + tp[p] * page_stride; const float* vpage = vp + tp[p] * page_stride;
        const int64_t ntok = std::min(B, length - p * B);
        for (int64_t t = 0; t < ntok; ++t) {
          const float* krow = kpage + t * tok_stride;
          for (int64_t h = 0; h < H; ++h) {
            const float* kr = krow + (h / G) * D; const float* qh = qp + h * D; float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * kr[d];
            s[h * B + t] = dot * scale;
          }
        }
        for (int64_t h = 0; h < H; ++h) {
          float mx = m[h];
          for (int64_t t = 0; t < ntok; ++t) mx = std::max(mx, s[h * B + t]);
          const float corr = std::exp(m[h] - mx);
          float lsum = l[h] * corr;
          for (int64_t t = 0; t < ntok; ++t) { const float e = std::exp(s[h * B + t] - mx); w[h * B + t] = e; lsum += e; }
          float* a = acc + h * D;
          #pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= corr;
          m[h] = mx; l[h] = lsum;
        }
        for (int64_t t = 0; t < ntok; ++t) {
          const float* vrow = vpage + t * tok_stride;
          for (int64_t h = 0; h < H; ++h) {
            const float* vr = vrow + (h / G) * D; float* a = acc + h * D; const float wt = w[h * B + t];
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += wt * vr[d];
          }
        }
      }
    }
  });
  auto out = torch::empty({H, D}, q.options()); float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, M[c * H + h]);
    float tot = 0.f;
    for (int64_t d = 0; d < D; ++d) op[h * D + d] = 0.f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float wc = std::exp(M[c * H + h] - mx); tot += L[c * H + h] * wc;
      for (int64_t d = 0; d < D; ++d) op[h * D + d] += ACC[(c * H + h) * D + d] * wc;
    }
    for (int64_t d = 0; d < D; ++d) op[h * D + d] /= tot;
  }
  return out;
}
'''


def paged_cpp(threads: int = 2, context: int = 2048, rounds: int = 15) -> None:
    """Median wall ms of `rounds` interleaved 12-layer passes (each writes this step's row, then
    attends context + 1 positions), and the K/V bandwidth that is; the build's time first."""
    import dataclasses

    import torch
    from torch.utils.cpp_extension import load_inline

    from service.parallel.kv_cache import AppendPlan, PagedKVPool, paged_attention
    from service.parallel.paged_kernel import DECODE_ALONE_UP_TO, DECODE_BUCKETS, InPlaceAttention

    t0 = time.perf_counter()
    ext = load_inline("paged_decode_candidate_tokens", cpp_sources=_PAGED_DECODE_CPP, functions=["paged_decode"],
                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"])
    print(f"paged_cpp: build {time.perf_counter() - t0:.1f} s", flush=True)
    torch.set_num_threads(threads)
    block, heads, head_dim, layers = 16, 12, 64, 12
    per = -(-(context + 1) // block)
    num_blocks = per + 64
    table = tuple(int(b) for b in np.random.default_rng(0).permutation(num_blocks)[:per])
    pool = PagedKVPool(num_blocks, block, heads, head_dim, torch.float32, torch.device("cpu"), layers=layers)
    pool.k.normal_()
    pool.v.normal_()
    scale = head_dim ** -0.5
    plan = AppendPlan(num_blocks, block, (1,), (context,), (table,))
    q, k, v = (torch.randn(1, heads, head_dim) for _ in range(3))
    kernel = InPlaceAttention(num_blocks, block, heads, heads, head_dim, torch.float32, decode_buckets=DECODE_BUCKETS,
                              alone_up_to=DECODE_ALONE_UP_TO)
    with torch.inference_mode():
        kernel.warm(pool.k[0], pool.v[0], scale, budget_s=600)
    tab = torch.tensor(table, dtype=torch.int64)
    slot = table[context // block] * block + context % block

    def step(which: str) -> list[torch.Tensor]:
        if which == "cpp":
            outs = []
            for layer in range(layers):
                pool.k[layer].view(-1, heads, head_dim)[slot] = k[0]
                pool.v[layer].view(-1, heads, head_dim)[slot] = v[0]
                outs.append(ext.paged_decode(q[0], pool.k[layer], pool.v[layer], tab, context + 1, scale))
            return outs
        pool.attention = None if which == "gather" else kernel
        fresh = dataclasses.replace(plan)  # a served step's plan is a new object
        return [paged_attention(pool, layer, q, k, v, fresh, scale) for layer in range(layers)]

    labels = {"gather": "gather", "flex": "flex (the service's)", "cpp": "cpp"}
    times: dict[str, list[float]] = {name: [] for name in labels}
    with torch.inference_mode():
        ref, got = step("gather"), step("cpp")
        err = max(float((g.reshape(-1) - r.reshape(-1)).abs().max()) for g, r in zip(got, ref))
        print(f"paged_cpp: max |cpp - gather| over the 12 layers' outputs {err:.2e}", flush=True)
        for _ in range(3):
            for name in times:
                step(name)
        for _ in range(rounds):
            for name in times:
                t1 = time.perf_counter()
                step(name)
                times[name].append((time.perf_counter() - t1) * 1000)
    kv_bytes = 2 * layers * (context + 1) * heads * head_dim * 4
    print(f"paged_cpp: one session at {context}, {threads} thread(s), load {os.getloadavg()[0]:.1f}: " + "; ".join(
        f"{labels[name]} {statistics.median(ts):.2f} ms ({kv_bytes / statistics.median(ts) / 1e6:.1f} GB/s of K/V)"
        for name, ts in times.items()), flush=True)


def warmup_once(num_blocks: int = 400) -> None:
    """One process's warm-ups (run by `warmup` with TORCHINDUCTOR_CACHE_DIR set): the first, then a
    second kernel over a new pool of the same shape, as a rebuilt gang's rank 0 warms it again."""
    import torch

    from service.parallel.kv_cache import PagedKVPool
    from service.parallel.paged_kernel import InPlaceAttention

    torch.set_num_threads(1)
    for which in ("first", "second, same process"):
        pool = PagedKVPool(num_blocks, 16, 12, 64, torch.float32, torch.device("cpu"), layers=1)
        kernel = InPlaceAttention(num_blocks, 16, 12, 12, 64, torch.float32)
        t0 = time.perf_counter()
        with torch.inference_mode():
            status = kernel.warm(pool.k[0], pool.v[0], 64 ** -0.5, budget_s=600)
        print(f"warmup: {which}: {time.perf_counter() - t0:.1f} s ({status.shapes} shapes; "
              f"load {os.getloadavg()[0]:.1f})", flush=True)


def warmup() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        for which in ("empty inductor cache", "the cache the first process left"):
            print(f"warmup: a fresh process, {which}:", flush=True)
            subprocess.run([sys.executable, __file__, "warmup_once"], check=True,
                           env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})


if __name__ == "__main__":
    if sys.argv[1:] == ["warmup_once"]:
        warmup_once()
        sys.exit()
    if sys.argv[1:2] == ["decode"] and len(sys.argv) >= 3:
        decode(threads=int(sys.argv[2]), **({"sessions": tuple(int(a) for a in sys.argv[3:])} if sys.argv[3:] else {}))
        sys.exit()
    if sys.argv[1:2] == ["paged_cpp"] and len(sys.argv) == 3:
        paged_cpp(threads=int(sys.argv[2]))
        sys.exit()
    if sys.argv[1:2] == ["heap"] and len(sys.argv) == 3:
        heap(sys.argv[2] == "kept")
        sys.exit()
    chosen = sys.argv[1:] or ["qkv", "heap", "encoder", "hops", "batcher", "decode", "paged_cpp", "warmup"]
    for lever in chosen:
        if lever == "heap":
            for mode in ("default", "kept"):
                subprocess.run([sys.executable, __file__, "heap", mode], check=True)
        else:
            {"qkv": qkv, "encoder": encoder, "hops": hops, "batcher": batcher, "decode": decode,
             "paged_cpp": paged_cpp, "warmup": warmup}[lever]()
