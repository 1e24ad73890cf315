"""The bare tensor-parallel step, without the service: 2 processes, gloo on loopback, one
torch thread each, the notes' shape. What a world-size-2 gang step cannot go below here.

    rank 0 broadcasts x [b, s, E] -> each rank computes its heads -> all_reduce of the output

Used by bench/run.py (`ours - (Serve echo + bare step)`): prints nothing, returns the
median step in milliseconds.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world_size: int, store_path: str, shape: tuple[int, ...], steps: int, out: str) -> None:
    from service.parallel import ParallelGroup, TensorParallelAttention
    from service.parallel.weights import seed_weights, shard_dense

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        group = ParallelGroup(rank, world_size, "gloo", torch.device("cpu"), dist.group.WORLD)
        model = TensorParallelAttention(shape[-1], 8, group)
        model.load_shard(shard_dense(seed_weights(shape[-1]), rank, world_size))
        x = torch.randn(shape) if rank == 0 else torch.empty(shape)
        times = []
        with torch.inference_mode():
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                group.broadcast_(x, src=0)
                model(x)
                times.append((time.perf_counter() - t0) * 1000)
        if rank == 0:
            with open(out, "w") as f:
                f.write(str(statistics.median(times[3:])))
    finally:
        dist.destroy_process_group()


def bare_step_ms(shape: tuple[int, ...] = (128, 8, 512), steps: int = 30, world_size: int = 2) -> float:
    """Median of `steps` bare TP steps (first 3 dropped) at `world_size` ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "median")
        mp.start_processes(_rank, args=(world_size, os.path.join(tmp, "store"), shape, steps, out),
                           nprocs=world_size, join=True, start_method="spawn")
        with open(out) as f:
            return float(f.read())


if __name__ == "__main__":
    print(f"bare ws2 TP step, notes' shape: {bare_step_ms():.1f} ms")
