"""Two of issue 44's levers, measured without the service (bench/NOTES.md records the results):

- `qkv`: three q/k/v projections [N, E] x [E/p, E]^T per rank against one fused [3E/p, E];
- `heap`: copying a [128, 8, 512] float32 output out of a shared region and npy-encoding it,
  with glibc's default malloc thresholds and with service.cluster.heap's (each in its own
  process: the thresholds are process-wide).

    python bench/micro_levers.py
"""
from __future__ import annotations

import mmap
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


if __name__ == "__main__":
    if sys.argv[1:2] == ["heap"]:
        heap(sys.argv[2] == "kept")
    else:
        qkv()
        for mode in ("default", "kept"):
            subprocess.run([sys.executable, __file__, "heap", mode], check=True)
