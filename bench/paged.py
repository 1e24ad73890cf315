"""Issue 52 items 2 and 3 in one process (no Serve): the sessions' attention over the KV pool
gathered (the path before) against read in place (the C++ decode kernel), and chunked prefill.

On the 12-layer E768 stack (GPT-2 small's shape, `model=transformer`), float32, a session of
2048 cached rows:

- `one_row`: one rank's attention of a one-row append over all 12 layers, per rank's heads at
  world size 1 (12 heads) and 2 (6), gather vs in place: median ms, and the K/V bytes each path
  moves (gather: read the blocks, write the copy, read the copy; in place: read the blocks);
- `append`: the whole world-size-1 stack's one-row append (`ParallelEncoder.append`), both paths;
- `cold_start`: the kernel's warm-up (`InPlaceAttention.warm`: build, load, check) in a fresh
  process, with an empty kernel directory and again with the library it left;
- `chunks`: the ws1 stack's step time for a chunk of C rows of a 2048-row prefill plus one other
  session's one-row append (what that append waits for), and the whole prefill's time, by C.

`python -m bench.paged` prints the tables; `bench/run.py --only sessions` runs it too.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

from service.parallel.group import ParallelGroup
from service.parallel.kv_cache import AppendPlan, PagedKVPool, paged_attention
from service.parallel.model import new_kv_pool, shard_dense
from service.parallel.paged_kernel import InPlaceAttention
from service.parallel.transformer import TransformerDef

STACK = TransformerDef(12, 768, 12, 3072, "gelu", True)
CONTEXT = 2048
BLOCK = 16
NUM_BLOCKS = 2 * CONTEXT // BLOCK + 64  # room for the session and a second one, as a served pool has


def _median_ms(fn: Callable[[], object], n: int, warmup: int = 2) -> float:
    from bench.run import time_calls  # the one timer of the bench (bench.run imports this module lazily)

    return time_calls(fn, n, warmup)["p50_ms"]


def _scattered_table(blocks: int, seed: int = 0) -> tuple[int, ...]:
    """A session's blocks as a long-lived pool holds them: anywhere, in no order."""
    return tuple(int(b) for b in np.random.default_rng(seed).permutation(NUM_BLOCKS)[:blocks])


def one_row(n: int = 30) -> dict[str, Any]:
    """Attention only, 12 layers, one rank's heads, one new row at position CONTEXT."""
    out: dict[str, Any] = {}
    d = STACK.head_dim
    table = _scattered_table(-(-(CONTEXT + 1) // BLOCK))
    plan = AppendPlan(NUM_BLOCKS, BLOCK, (1,), (CONTEXT,), (table,))
    for ws in (1, 2):
        heads = STACK.num_heads // ws
        pool = PagedKVPool(NUM_BLOCKS, BLOCK, heads, d, torch.float32, torch.device("cpu"), layers=STACK.num_layers)
        pool.k.normal_()
        pool.v.normal_()
        kernel = InPlaceAttention(NUM_BLOCKS, BLOCK, heads, heads, d, torch.float32)
        gen = torch.Generator().manual_seed(ws)
        q, k, v = (torch.randn(1, heads, d, generator=gen) for _ in range(3))

        def layers() -> None:
            with torch.inference_mode():
                for layer in range(STACK.num_layers):
                    paged_attention(pool, layer, q, k, v, plan, d ** -0.5)

        pool.attention = None
        gather_ms = _median_ms(layers, n)
        pool.attention = kernel
        kernel.warm(budget_s=600)
        in_place_ms = _median_ms(layers, n)
        kv_bytes = 2 * (CONTEXT + 1) * heads * d * 4 * STACK.num_layers  # K and V of the session, every layer
        padded = 2 * len(table) * BLOCK * heads * d * 4 * STACK.num_layers  # the gather copies whole blocks
        out[f"ws{ws}"] = {"heads": heads, "gather_ms": gather_ms, "in_place_ms": in_place_ms,
                          "kv_bytes": kv_bytes, "gather_bytes": 3 * padded, "in_place_bytes": kv_bytes}
    return out


def _stack(threads: int) -> Any:
    torch.set_num_threads(threads)
    model = STACK.build(ParallelGroup.single(), torch.float32)
    model.load_shard(shard_dense(STACK, STACK.init_weights("random", 0), 0, 1))
    return model.eval()


def append(n: int = 10) -> dict[str, float]:
    """The whole ws1 stack's one-row append at context CONTEXT: gather vs in place (1 thread)."""
    model = _stack(1)
    table = _scattered_table(-(-(CONTEXT + 1) // BLOCK))
    plan = AppendPlan(NUM_BLOCKS, BLOCK, (1,), (CONTEXT,), (table,))
    pool = new_kv_pool(STACK, 1, plan, torch.float32, torch.device("cpu"))
    pool.k.normal_()
    pool.v.normal_()
    x = torch.randn(1, STACK.embed_dim, generator=torch.Generator().manual_seed(1))
    kernel = InPlaceAttention(NUM_BLOCKS, BLOCK, STACK.num_heads, STACK.num_heads, STACK.head_dim, torch.float32)

    def step() -> None:
        with torch.inference_mode():
            model.append(x, plan, pool)

    gather_ms = _median_ms(step, n)
    pool.attention = kernel
    kernel.warm(budget_s=600)
    in_place_ms = _median_ms(step, n)
    weights = model.parameter_bytes()
    return {"gather_ms": gather_ms, "in_place_ms": in_place_ms, "weight_bytes": weights}


def chunks(sizes: tuple[int, ...] = (0, 128, 256, 512)) -> dict[str, dict[str, float]]:
    """The ws1 stack (2 threads), in place: a 2048-row prefill in chunks of C rows, each chunk's
    step also carrying another session's one-row append at context 512: its step time (what that
    append waits for) and the prefill's total."""
    model = _stack(2)
    rows = torch.randn(CONTEXT, STACK.embed_dim, generator=torch.Generator().manual_seed(2))
    other = _scattered_table(-(-513 // BLOCK), seed=1)
    free = [b for b in range(NUM_BLOCKS) if b not in set(other)]
    table = tuple(free[:CONTEXT // BLOCK])
    plan0 = AppendPlan(NUM_BLOCKS, BLOCK, (1,), (0,), ((table[0],),))
    pool = new_kv_pool(STACK, 1, plan0, torch.float32, torch.device("cpu"))
    kernel = InPlaceAttention(NUM_BLOCKS, BLOCK, STACK.num_heads, STACK.num_heads, STACK.head_dim, torch.float32)
    kernel.warm(budget_s=600)
    pool.attention = kernel
    out: dict[str, dict[str, float]] = {}
    for chunk in sizes:
        size = chunk or CONTEXT
        steps = []
        with torch.inference_mode():
            for at in range(0, CONTEXT, size):
                n = min(size, CONTEXT - at)
                plan = AppendPlan(NUM_BLOCKS, BLOCK, (n, 1), (at, 512),
                                  (table[:-(-(at + n) // BLOCK)], other))
                x = torch.cat([rows[at:at + n], rows[:1]])
                started = time.perf_counter()
                model.append(x, plan, pool)
                steps.append(time.perf_counter() - started)
        out[str(chunk)] = {"steps": len(steps), "step_ms_median": statistics.median(steps) * 1000,
                           "step_ms_max": max(steps) * 1000, "prefill_ms": sum(steps) * 1000}
    return out


_COLD = """
import json, time, torch
from bench.paged import NUM_BLOCKS, BLOCK, STACK
from service.parallel.paged_kernel import InPlaceAttention
torch.set_num_threads(1)
heads = STACK.num_heads // 2
status = InPlaceAttention(NUM_BLOCKS, BLOCK, heads, heads, STACK.head_dim, torch.float32).warm(budget_s=600)
print(json.dumps({"compile_s": status.compile_s, "shapes": status.shapes}))
"""


def cold_start() -> dict[str, dict[str, float]]:
    """A rank's warm-up (ws2's heads) in a fresh process: with an empty kernel directory (the
    build), then with the library the first left (what every later rank on the node pays)."""
    from service.parallel.native import KERNEL_DIR_ENV

    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, KERNEL_DIR_ENV: cache}
        for label in ("empty_cache", "warm_cache"):
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-c", _COLD], env=env, capture_output=True, text=True,
                                  timeout=1200, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["process_s"] = time.monotonic() - started
            out[label] = row
    return out


def bench_paged() -> dict[str, Any]:
    return {"load_average_start": os.getloadavg(), "one_row": one_row(), "append": append(), "chunks": chunks(),
            "cold_start": cold_start(), "load_average_end": os.getloadavg()}


def print_paged(d: dict[str, Any]) -> dict[str, float]:
    mb = 1e6
    print(f"\nsessions' attention over the KV pool (issue 52), in process, {STACK.num_layers}-layer E{STACK.embed_dim} "
          f"stack, float32, a session of {CONTEXT} cached rows in blocks of {BLOCK} (scattered), 1 thread; load "
          f"average {', '.join(f'{v:.1f}' for v in d['load_average_start'])} at the start\n")
    print("| one-row append, 12 layers | heads per rank | gather ms | in place ms | K/V MB moved: gather | in place |")
    print("|---|---:|---:|---:|---:|---:|")
    ratios: dict[str, float] = {}
    for ws, r in d["one_row"].items():
        print(f"| attention only, {ws} | {r['heads']} | {r['gather_ms']:.2f} | {r['in_place_ms']:.2f} | "
              f"{r['gather_bytes'] / mb:.1f} | {r['in_place_bytes'] / mb:.1f} |")
        ratios[f"{ws} attention, gather / in place, ms"] = r["gather_ms"] / r["in_place_ms"]
    a = d["append"]
    print(f"| whole stack's append, ws1 (weights {a['weight_bytes'] / mb:.0f} MB) | 12 | {a['gather_ms']:.1f} | "
          f"{a['in_place_ms']:.1f} | | |")
    ratios["ws1 stack append, gather / in place, ms"] = a["gather_ms"] / a["in_place_ms"]
    print("\n| chunked prefill of 2048 rows (ws1 stack, 2 threads; decode in place, chunks gathered), C | steps | step ms (median) | "
          "step ms (max) = another session's one-row append waits | prefill ms |")
    print("|---|---:|---:|---:|---:|")
    for c, r in d["chunks"].items():
        print(f"| {c if c != '0' else 'off'} | {r['steps']} | {r['step_ms_median']:.0f} | {r['step_ms_max']:.0f} | "
              f"{r['prefill_ms']:.0f} |")
    cs = d["cold_start"]
    print(f"\ncold start of the in-place kernel (a ws2 rank's warm-up, fresh process): empty kernel directory "
          f"{cs['empty_cache']['compile_s']:.2f} s (build, load, check; {cs['empty_cache']['process_s']:.1f} s with "
          f"the process); with the library it left {cs['warm_cache']['compile_s']:.3f} s")
    ratios["cold start s, empty cache"] = cs["empty_cache"]["compile_s"]
    ratios["cold start s, warm cache"] = cs["warm_cache"]["compile_s"]
    return {k: round(v, 3) for k, v in ratios.items()}


if __name__ == "__main__":
    result = bench_paged()
    print(json.dumps(result, indent=1, default=str))
    print(json.dumps(print_paged(result), indent=1))
