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
  E768 stack's pool at world size 1, 12 heads of 64, 16-token pages scattered, every session near
  context 2048, one new row each) for S sessions, interleaved: the gather path against the C++
  decode kernel in place (service.parallel.paged_kernel), wall and CPU ms and the K/V GB/s read.
  `decode N [S ...]` runs it with N threads (1) and those numbers of sessions (1 2 4 8 16 32).

    python bench/micro_levers.py [qkv heap encoder hops batcher decode]   (all by default)
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


def decode(sessions: tuple[int, ...] = (1, 2, 4, 8, 16, 32), rounds: int = 7, context: int = 2048,
           threads: int = 1) -> None:
    """Per S: the median (and min) wall ms and the median CPU ms (`time.process_time`) of
    `rounds` interleaved rounds (each path once per round, shuffled). With one thread the CPU
    time is the work done, whatever the machine's load (a shared machine's wall time is not).
    Each call gets a plan object of its own, as a served step does (the kernel builds a step's
    tables once per plan). Session i is at context - 3 i (served sessions' lengths differ)."""
    import dataclasses
    import random

    import torch

    from service.parallel.kv_cache import AppendPlan, PagedKVPool, paged_attention
    from service.parallel.paged_kernel import InPlaceAttention

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
    kernel = InPlaceAttention(num_blocks, block, heads, heads, head_dim, torch.float32)
    t0 = time.perf_counter()
    print(f"decode: the kernel's warm-up {kernel.warm(budget_s=600).compile_s:.3f} s "
          f"({time.perf_counter() - t0:.3f} s wall)", flush=True)
    kernels: dict[str, InPlaceAttention | None] = {"gather": None, "in place": kernel}
    shuffle = random.Random(52)
    for s in sessions:
        plan = AppendPlan(num_blocks, block, (1,) * s, tuple(lengths[:s]), tables[:s])
        q, k, v = (torch.randn(s, heads, head_dim) for _ in range(3))

        def step(chosen: InPlaceAttention | None) -> None:
            pool.attention = chosen
            fresh = dataclasses.replace(plan)  # a served step's plan is a new object
            for layer in range(layers):
                paged_attention(pool, layer, q, k, v, fresh, scale)

        wall: dict[str, list[float]] = {name: [] for name in kernels}
        cpu: dict[str, list[float]] = {name: [] for name in kernels}
        with torch.inference_mode():
            for chosen in kernels.values():
                step(chosen)
            for _ in range(rounds):
                names = list(kernels)
                shuffle.shuffle(names)
                for name in names:
                    c0, t0 = time.process_time(), time.perf_counter()
                    step(kernels[name])
                    wall[name].append((time.perf_counter() - t0) * 1000)
                    cpu[name].append((time.process_time() - c0) * 1000)
        kv_bytes = 2 * layers * sum(n + 1 for n in lengths[:s]) * heads * head_dim * 4
        base = statistics.median(cpu["gather"])
        print(f"decode S={s} at {context}, {threads} thread(s), load {os.getloadavg()[0]:.1f}: " + "; ".join(
            f"{name} cpu {statistics.median(cpu[name]):.1f} ms (x{statistics.median(cpu[name]) / base:.2f}), "
            f"wall {statistics.median(wall[name]):.1f} (min {min(wall[name]):.1f}; "
            f"{kv_bytes / statistics.median(wall[name]) / 1e6:.1f} GB/s of K/V)" for name in kernels), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["decode"] and len(sys.argv) >= 3:
        decode(threads=int(sys.argv[2]), **({"sessions": tuple(int(a) for a in sys.argv[3:])} if sys.argv[3:] else {}))
        sys.exit()
    if sys.argv[1:2] == ["heap"] and len(sys.argv) == 3:
        heap(sys.argv[2] == "kept")
        sys.exit()
    chosen = sys.argv[1:] or ["qkv", "heap", "encoder", "hops", "batcher", "decode"]
    for lever in chosen:
        if lever == "heap":
            for mode in ("default", "kept"):
                subprocess.run([sys.executable, __file__, "heap", mode], check=True)
        else:
            {"qkv": qkv, "encoder": encoder, "hops": hops, "batcher": batcher, "decode": decode}[lever]()
