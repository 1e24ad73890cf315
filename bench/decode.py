"""The decode step against the memory floor, in one run (issue 52, item 4; `make bench` runs it).

For each stack (the 12-layer E768 `model=transformer`, GPT-2 small's shape, and bench/llama.py's
Llama stack), each world size p and each S sessions at `context` cached rows:

- **the step**: the S sessions append one row each, together, in `rounds` rounds. The batcher
  lingers `LINGER_S` for company, so a round is one gang step (the steps are counted: GET /gang
  `sessions.batching`, and reported as appends per step; `max_batch_size` is S + 1, so the prefill
  goal's prefilling session fits a step beside S decoding ones). The step's time is the `compute` part
  of each append's Server-Timing (rank 0's layers, service.metrics.timeline; at p = 2 the
  `all_reduce` part is beside it), median over the rounds;
- **the floor**, per rank: (W/p + sum_i KV_i/p) / B. W/p is rank 0's parameter bytes (GET /gang
  `param_bytes_per_rank`), KV_i/p session i's cached K/V on one rank after its append (its length
  x `sessions.bytes_per_token_per_rank`), B the copy bandwidth of the device: bytes read plus
  bytes written per second by `dst.copy_(src)` of a 1 GiB float32 tensor (median of 5), measured
  **in this bench process** on the same CPU and memory as the ranks, right before each gang's
  rows (`copy_bandwidth`);
- **rows per second end to end**: S x rounds rows over the rounds' wall time, as the client sees
  it (HTTP, the linger, the step).

The prefill goal (`stall`): `STALL_SESSIONS` sessions' one-row appends, a step per round, first
alone (p50), then while another session opens with a `prefill_rows`-row prefill (chunked:
tunables.gang.session_prefill_chunk_tokens): their p99 meanwhile <= 3 x the p50 without it.

The in-process step (`in_process_steps`: the world-size-1 stack's `append` of S one-row appends over
a pool, no service) is what bench/gpu's tier A reports for the first lent GPU; this module imports
nothing beyond torch, numpy and the service's Ray-free modules at its top for that reason.

The load generator only sends: every body is built before the first timed call.

    .venv/bin/python bench/decode.py                                  # the issue's matrix
    .venv/bin/python bench/decode.py --sessions 1 8 --stacks transformer --rounds 3   # a smaller run
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 1 << 30
LINGER_S = 0.05  # the batcher's wait for company (batch_wait_timeout_s): a round's S appends make one step
STALL_SESSIONS = 8
# The 12-layer E768 stack: bench/run.py's MODEL_STACKS row, as builder arguments.
TRANSFORMER = {"model": "transformer", "num_layers": 12, "embed_dim": 768, "num_heads": 12, "ffn_dim": 3072,
               "activation": "gelu", "norm_first": True}


# ------------------------------------------------------------------ the floor

def copy_bandwidth(device: torch.device, nbytes: int = GIB, repeats: int = 5) -> float:
    """B: bytes moved per second (read + written: 2 x nbytes) by `dst.copy_(src)` of an
    `nbytes` float32 tensor on `device`, the median of `repeats` copies after one warm copy."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [_timed(device, lambda: dst.copy_(src)) for _ in range(repeats)]
    del src, dst
    return 2 * nbytes / statistics.median(times)


def floor_ms(weight_bytes_per_rank: int, kv_bytes_per_rank: int, bandwidth: float) -> float:
    """The step's memory floor on one rank: its weights and its sessions' K/V read once, at B."""
    return (weight_bytes_per_rank + kv_bytes_per_rank) / bandwidth * 1000


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepRow:
    """One (stack, world size, S) row of the floor table."""

    stack: str
    world_size: int
    sessions: int
    context: int
    compute_ms: float  # median step compute (served: Server-Timing `compute`; in process: the call)
    floor_ms: float
    weight_bytes_per_rank: int
    kv_bytes_per_rank: int
    bandwidth_gbs: float  # B, GB/s (1e9), read + written
    all_reduce_ms: float | None = None  # served, p > 1: Server-Timing `all_reduce`
    rows_per_s: float | None = None  # served: end to end
    appends_per_step: float | None = None  # served: S when every round was one step
    where: str = "served"
    # In process: the median over the steps of each step / the floor at the B measured right
    # before it (`in_process_steps`); compute_ms, floor_ms and B are then the medians of each.
    paired_ratio: float | None = None

    @property
    def ratio(self) -> float:
        return self.paired_ratio if self.paired_ratio is not None else self.compute_ms / self.floor_ms


# ------------------------------------------------------------------ in process (bench/gpu)

def stack_def(stack: str) -> Any:
    """The stack's ModelDef as a rank resolves it (service.parallel.registry); the Llama stack's
    architecture from its LlamaConfig fields (bench/llama.py's ARCH), no checkpoint needed."""
    from service.gang.worker import PlainModel
    from service.parallel.registry import resolve

    if stack == "transformer":
        return resolve(PlainModel(kind="transformer", **{k: v for k, v in TRANSFORMER.items() if k != "model"}))
    arch = _llama_arch()
    return resolve(PlainModel(kind="llama", embed_dim=arch["hidden_size"], num_heads=arch["num_attention_heads"],
                              model_args=arch))


def in_process_steps(stack: str, sessions: tuple[int, ...], context: int, device: torch.device, dtype: torch.dtype,
                     repeats: int, block: int = 16, copy_bytes: int = GIB, in_place: bool = False,
                     varlen: bool = False) -> list[StepRow]:
    """The world-size-1 stack's step of S one-row appends for each S in `sessions`, each session
    at `context` cached rows (random K/V, scattered blocks of one pool sized for the largest S),
    without the service: `repeats` synchronized `append` calls, each against the floor at the B
    of a `copy_bytes` copy on `device` right before it (the row's ratio: the median of those).
    The attention: the gather path (a CUDA rank's), or with `in_place` the C++ decode kernel over
    the pool's blocks, warmed first as a CPU rank warms it at bring-up
    (service.parallel.paged_kernel). `varlen`: a CUDA rank's in-place path instead
    (service.parallel.paged_varlen, bf16/fp16, `block` a multiple of 256), checked at warm-up as
    a rank checks it; where the check refuses, the rows say why and use the gather path."""
    from service.parallel.group import ParallelGroup
    from service.parallel.kv_cache import AppendPlan
    from service.parallel.model import kv_bytes_per_token, kv_heads_per_rank, new_kv_pool, shard_dense
    from service.gang.worker import query_heads_per_rank
    from service.parallel.paged_kernel import InPlaceAttention

    model_def = stack_def(stack)
    model = model_def.build(ParallelGroup.single(device), dtype)
    model.load_shard(shard_dense(model_def, model_def.init_weights("random", 0), 0, 1))
    model.eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = kv_bytes_per_token(model_def, 1, torch.empty((), dtype=dtype).element_size())
    per_session = -(-(context + 1) // block)
    num_blocks = max(sessions) * per_session + 8
    order = np.random.default_rng(0).permutation(num_blocks)
    tables = [tuple(int(b) for b in order[i * per_session:(i + 1) * per_session]) for i in range(max(sessions))]
    plans = {s: AppendPlan(num_blocks, block, (1,) * s, (context,) * s, tuple(tables[:s])) for s in sessions}
    pool = new_kv_pool(model_def, 1, plans[max(sessions)], dtype, device)
    pool.k.normal_()
    pool.v.normal_()
    path = "gather"
    if in_place:
        kernel = InPlaceAttention(num_blocks, block, query_heads_per_rank(model_def, 1), kv_heads_per_rank(model_def, 1),
                                  model_def.head_dim, dtype)
        status = kernel.warm(budget_s=600)
        if status.in_place:
            pool.attention, path = kernel, "in place (the C++ decode kernel)"
        else:
            path = f"gather (the in-place kernel refused: {status.reason})"
    elif varlen:
        from service.parallel.kv_cache import warm_varlen
        from service.parallel.paged_varlen import VarlenAttention

        kernel_v = VarlenAttention(num_blocks, block, query_heads_per_rank(model_def, 1), kv_heads_per_rank(model_def, 1),
                                   model_def.head_dim, dtype)
        status = warm_varlen(kernel_v, device, model_def.head_dim ** -0.5)
        if status.path == "varlen":
            pool.attention, path = kernel_v, f"varlen, pages of {block}"
        else:
            path = f"gather (varlen refused: {status.reason})"
    # B is measured before every timed step, not once after them all: this machine's bandwidth
    # moves by 1.5x within minutes, and a floor from another minute's B read 0.9x for one run
    # and 1.5x for the next of the same step. Each step is set against the B of the copy
    # right before it; the row's ratio is the median of those.
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    timed: list[tuple[int, int, float, float, float]] = []  # S, K/V bytes, median step ms, median B, median ratio
    for s in sessions:
        x = torch.randn(s, model_def.embed_dim, device=device, dtype=dtype)
        kv = s * (context + 1) * per_token
        steps, bandwidths, ratios = [], [], []
        with torch.inference_mode():
            model.append(x, plans[s], pool)  # warms
            for _ in range(repeats):
                bandwidth = 2 * copy_bytes / _timed(device, lambda: dst.copy_(src))
                ms = _timed(device, lambda: model.append(x, plans[s], pool)) * 1000
                steps.append(ms)
                bandwidths.append(bandwidth)
                ratios.append(ms / floor_ms(weights, kv, bandwidth))
        timed.append((s, kv, statistics.median(steps), statistics.median(bandwidths), statistics.median(ratios)))
    del pool, model, src, dst
    rows = []
    for s, kv, ms, bandwidth, ratio in timed:
        rows.append(StepRow(stack=stack, world_size=1, sessions=s, context=context, compute_ms=ms,
                            floor_ms=floor_ms(weights, kv, bandwidth), weight_bytes_per_rank=weights,
                            kv_bytes_per_rank=kv, bandwidth_gbs=bandwidth / 1e9, paired_ratio=ratio,
                            where=f"in process, {device.type}, {str(dtype)[6:]}, {path}"))
    return rows


def _timed(device: torch.device, call: Callable[[], object]) -> float:
    """Seconds of one synchronized call."""
    _sync(device)
    started = time.perf_counter()
    call()
    _sync(device)
    return time.perf_counter() - started


# ------------------------------------------------------------------ served

@dataclass
class Sizes:
    """The run's matrix: the issue's values by default (`--help` names the arguments)."""

    sessions: tuple[int, ...] = (1, 8, 32)
    context: int = 2048
    world_sizes: tuple[int, ...] = (1, 2)
    stacks: tuple[str, ...] = ("transformer", "llama")
    rounds: int = 5
    prefill_rows: int = 4096  # 0: no prefill goal
    stall_rounds: int = 12
    chunk_tokens: int | None = None  # None: the service's default (tunables.gang.session_prefill_chunk_tokens)
    attention: str = "auto"  # tunables.gang.session_attention ("gather": the path before item 2)
    block_tokens: int | None = None  # session_block_tokens (the page size); None: the service's default
    threads_per_rank: int | None = None  # torch_threads_per_rank; None: the cores over the world size
    chunk_linger_s: float | None = None  # None: the service's default (tunables.gang.session_prefill_chunk_linger_s)
    batch_wait_s: float = LINGER_S  # batch_wait_timeout_s (0: the service's default, no wait for company)
    step_ratio: float | None = None  # None: the service's default (tunables.gang.session_prefill_step_ratio)


@dataclass
class Stall:
    """The prefill goal at one (stack, world size): appends' latencies alone and beside a prefill."""

    stack: str
    world_size: int
    sessions: int
    prefill_rows: int
    alone_p50_ms: float
    beside_p50_ms: float
    beside_p99_ms: float
    beside_appends: int
    prefill_s: float
    beside_compute_p99_ms: float  # the Server-Timing `compute` of those appends' steps

    @property
    def ratio(self) -> float:
        return self.beside_p99_ms / self.alone_p50_ms


@dataclass
class Run:
    sizes: Sizes
    rows: list[StepRow] = field(default_factory=list)
    stalls: list[Stall] = field(default_factory=list)
    attention: dict[str, Any] = field(default_factory=dict)  # (stack, ws) -> GET /gang sessions.attention
    load_average: list[tuple[float, float, float]] = field(default_factory=list)


def _npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    return buf.getvalue()


def _parts(headers: Any) -> dict[str, float]:
    from bench.run import server_timing

    return server_timing(headers)


NPY = {"content-type": "application/x-npy", "x-request-timeout-seconds": "600"}


class Driver:
    """The load generator of one served gang: it opens sessions and sends appends; every body is
    made before the timed calls (`bodies`)."""

    def __init__(self, base: str, dim: int, seed: int) -> None:
        import httpx

        self.base, self.dim = base, dim
        self.client = httpx.Client(timeout=900, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
        self.rng = np.random.default_rng(seed)

    def bodies(self, n: int) -> list[bytes]:
        return [_npy(r[None]) for r in self.rng.standard_normal((n, self.dim), dtype=np.float32)]

    def open_body(self, rows: int) -> Callable[[], tuple[str, float]]:
        """A session open of `rows` rows, its body made now; the call returns (its id, its seconds)."""
        body = _npy(self.rng.standard_normal((rows, self.dim), dtype=np.float32))

        def call() -> tuple[str, float]:
            started = time.perf_counter()
            r = self.client.post(f"{self.base}/sessions", content=body, headers=NPY)
            assert r.status_code == 201, r.text[:300]
            return r.headers["x-session-id"], time.perf_counter() - started
        return call

    def append(self, sid: str, body: bytes) -> tuple[float, dict[str, float], int]:
        """One append -> (client seconds, its Server-Timing parts, the session's length after it)."""
        started = time.perf_counter()
        r = self.client.post(f"{self.base}/sessions/{sid}/append", content=body, headers=NPY)
        took = time.perf_counter() - started
        assert r.status_code == 200, r.text[:300]
        return took, _parts(r.headers), int(r.headers["x-session-length"])

    def round(self, pool: ThreadPoolExecutor, sids: list[str], bodies: list[bytes]) -> list[tuple[float, dict, int]]:
        """Every session in `sids` appends its body at once (one step: the batcher's linger)."""
        return list(pool.map(self.append, sids, bodies))

    def gang(self) -> dict[str, Any]:
        return self.client.get(f"{self.base}/gang").json()


def _app_args(stack: str, ws: int, sizes: Sizes, checkpoint: Path | None) -> dict[str, Any]:
    from harness.local import local_yaml_args

    arch = TRANSFORMER if stack == "transformer" else {"model": "llama", "checkpoint": str(checkpoint)}
    dim = TRANSFORMER["embed_dim"] if stack == "transformer" else _llama_arch()["hidden_size"]
    layers = TRANSFORMER["num_layers"] if stack == "transformer" else _llama_arch()["num_hidden_layers"]
    grown = sizes.context + len(sizes.sessions) * (sizes.rounds + 1) + sizes.stall_rounds * 3 + 64
    tokens = max(sizes.sessions) * grown + sizes.prefill_rows + 256
    # An upper bound of one rank's K/V per token (every head of every layer, float32): the pool
    # holds every session at once, so no session is evicted and recomputed mid-measure.
    per_token = 2 * layers * dim * 4 // ws
    cores = os.cpu_count() or 2
    tunables: dict[str, Any] = {"gang": {"session_attention": sizes.attention}}
    if sizes.chunk_tokens is not None:
        tunables["gang"]["session_prefill_chunk_tokens"] = sizes.chunk_tokens
    if sizes.chunk_linger_s is not None:
        tunables["gang"]["session_prefill_chunk_linger_s"] = sizes.chunk_linger_s
    if sizes.step_ratio is not None:
        tunables["gang"]["session_prefill_step_ratio"] = sizes.step_ratio
    # The Llama stack's width, heads and weights come from its checkpoint (bench/llama.py's), not the yaml's.
    base = local_yaml_args() if stack == "transformer" else {
        k: v for k, v in local_yaml_args().items() if k not in ("embed_dim", "num_heads", "init", "seed")}
    weights = {"init": "random", "seed": 0} if stack == "transformer" else {}
    return {**base, **arch, **weights, "world_size": ws,
            "cpus_per_rank": cores / ws, "torch_threads_per_rank": sizes.threads_per_rank or max(1, cores // ws),
            "warm_spare": False,
            "collective_timeout_s": 300, "max_seq_len": max(4096, sizes.prefill_rows, grown),
            "max_session_tokens": max(4096, sizes.prefill_rows, grown), "max_batch_size": max(sizes.sessions) + 1,
            "batch_wait_timeout_s": sizes.batch_wait_s, "session_cache_bytes": tokens * per_token, "tunables": tunables,
            **({"session_block_tokens": sizes.block_tokens} if sizes.block_tokens is not None else {})}


def _llama_arch() -> dict[str, Any]:
    from bench.llama import ARCH

    return ARCH


def measure_gang(driver: Driver, stack: str, ws: int, sizes: Sizes, run: Run) -> None:
    """The floor rows and the prefill goal of one served gang."""
    gang = driver.gang()
    run.attention[f"{stack} ws{ws}"] = gang["sessions"]["attention"]
    weights = int(gang["param_bytes_per_rank"][0])
    per_token = int(gang["sessions"]["bytes_per_token_per_rank"])
    most = max(sizes.sessions)
    opens = [driver.open_body(sizes.context) for _ in range(most)]
    bodies = {s: [driver.bodies(s) for _ in range(sizes.rounds + 1)] for s in sizes.sessions}
    with ThreadPoolExecutor(4) as pool:  # opens overlap: their chunks share steps
        sids = [sid for sid, _ in pool.map(lambda call: call(), opens)]
    with ThreadPoolExecutor(most) as pool:
        for s in sizes.sessions:
            driver.round(pool, sids[:s], bodies[s][0])  # warm: not timed
            batching = driver.gang()["sessions"]["batching"]
            compute, reduce, kv = [], [], []
            started = time.perf_counter()
            for r in range(1, sizes.rounds + 1):
                answers = driver.round(pool, sids[:s], bodies[s][r])
                compute.append(statistics.median(a[1].get("compute", float("nan")) for a in answers))
                reduce.append(statistics.median(a[1].get("all_reduce", 0.0) for a in answers))
                kv.append(sum(a[2] for a in answers) * per_token)
            wall = time.perf_counter() - started
            after = driver.gang()["sessions"]["batching"]
            bandwidth = copy_bandwidth(torch.device("cpu"))
            kv_bytes = int(statistics.median(kv))
            run.rows.append(StepRow(
                stack=stack, world_size=ws, sessions=s, context=sizes.context, compute_ms=statistics.median(compute),
                floor_ms=floor_ms(weights, kv_bytes, bandwidth), weight_bytes_per_rank=weights,
                kv_bytes_per_rank=kv_bytes, bandwidth_gbs=bandwidth / 1e9,
                all_reduce_ms=statistics.median(reduce) if ws > 1 else None, rows_per_s=s * sizes.rounds / wall,
                appends_per_step=(after["appends"] - batching["appends"]) / max(1, after["steps"] - batching["steps"])))
            print(json.dumps(asdict(run.rows[-1])), flush=True)
    if sizes.prefill_rows:
        run.stalls.append(stall(driver, stack, ws, sids[:STALL_SESSIONS], sizes))
        print(json.dumps(asdict(run.stalls[-1])), flush=True)


def stall(driver: Driver, stack: str, ws: int, sids: list[str], sizes: Sizes) -> Stall:
    """`sids` append one row each per round: `stall_rounds` rounds alone, then rounds while
    another session opens with `prefill_rows` rows, until that open answers."""
    alone_bodies = [driver.bodies(len(sids)) for _ in range(sizes.stall_rounds)]
    beside_bodies = [driver.bodies(len(sids)) for _ in range(4 * sizes.stall_rounds)]
    prefill = driver.open_body(sizes.prefill_rows)
    alone: list[float] = []
    beside: list[float] = []
    beside_compute: list[float] = []
    with ThreadPoolExecutor(len(sids) + 1) as pool:
        for bodies in alone_bodies:
            alone += [a[0] for a in driver.round(pool, sids, bodies)]
        opened = pool.submit(prefill)
        for bodies in beside_bodies:
            answers = driver.round(pool, sids, bodies)
            beside += [a[0] for a in answers]
            beside_compute += [a[1].get("compute", float("nan")) for a in answers]
            if opened.done():
                break
        prefill_s = opened.result()[1]
    ms = sorted(t * 1000 for t in beside)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return Stall(stack=stack, world_size=ws, sessions=len(sids), prefill_rows=sizes.prefill_rows,
                 alone_p50_ms=statistics.median(alone) * 1000, beside_p50_ms=statistics.median(ms), beside_p99_ms=p99,
                 beside_appends=len(ms), prefill_s=prefill_s,
                 beside_compute_p99_ms=sorted(beside_compute)[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))])


def bench_decode(sizes: Sizes) -> Run:
    """Every (stack, world size) gang of `sizes`, one at a time (the cores are shared)."""
    import ray
    from ray import serve

    from harness.local import free_port, front_door_env
    from service.app import build_app

    run = Run(sizes)
    checkpoint = None
    if "llama" in sizes.stacks:
        from bench.llama import save_stack

        checkpoint = Path(tempfile.mkdtemp(prefix="gangserve-decode-bench-")) / "stack"
        save_stack(checkpoint)
    os.environ.update(front_door_env())
    os.environ.setdefault("GANGSERVE_STATE_DIR", tempfile.mkdtemp(prefix="gangserve-bench-"))
    cores = os.cpu_count() or 1
    ray.init(address="local", num_cpus=max(8, cores), include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    torch.set_num_threads(cores)
    try:
        for stack in sizes.stacks:
            for ws in sizes.world_sizes:
                run.load_average.append(os.getloadavg())
                name = f"decode_{stack}_{ws}"
                serve.run(build_app(_app_args(stack, ws, sizes, checkpoint)), name=name, route_prefix=f"/{name}")
                dim = TRANSFORMER["embed_dim"] if stack == "transformer" else _llama_arch()["hidden_size"]
                measure_gang(Driver(f"http://127.0.0.1:{port}/{name}", dim, seed=ws), stack, ws, sizes, run)
                serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()
    run.load_average.append(os.getloadavg())
    return run


def print_rows(rows: list[StepRow]) -> None:
    mb = 1e6
    print("\n| stack | p | S | context | step compute ms | floor ms | compute / floor | W/p MB | sum KV/p MB | "
          "B GB/s | all_reduce ms | rows/s end to end | appends/step | where |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        extra = [f"{r.all_reduce_ms:.1f}" if r.all_reduce_ms is not None else "",
                 f"{r.rows_per_s:.1f}" if r.rows_per_s is not None else "",
                 f"{r.appends_per_step:.1f}" if r.appends_per_step is not None else ""]
        print(f"| {r.stack} | {r.world_size} | {r.sessions} | {r.context} | {r.compute_ms:.1f} | {r.floor_ms:.1f} | "
              f"{r.ratio:.2f} | {r.weight_bytes_per_rank / mb:.0f} | {r.kv_bytes_per_rank / mb:.0f} | "
              f"{r.bandwidth_gbs:.1f} | {' | '.join(extra)} | {r.where} |")


def print_run(run: Run) -> dict[str, float]:
    s = run.sizes
    loads = ", ".join(f"{v[0]:.1f}" for v in run.load_average) or "not taken"
    print(f"\nthe decode step against the memory floor: S sessions at context {s.context}, one-row appends, "
          f"{s.rounds} rounds; attention {s.attention}; load average (1 min) before each gang and at the end: {loads}")
    print_rows(run.rows)
    goals: dict[str, float] = {}
    for r in run.rows:
        if r.world_size == 1 and r.sessions in (1, 32):
            goals[f"{r.stack} ws1 S={r.sessions} ({r.where}): step compute / floor (goal <= 1.3)"] = r.ratio
    if run.stalls:
        print(f"\n| stack | p | sessions | appends alone p50 ms | beside a {s.prefill_rows}-row prefill: p50 ms | p99 ms | "
              "p99 / alone p50 | appends | prefill s | their steps' compute p99 ms |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for t in run.stalls:
            print(f"| {t.stack} | {t.world_size} | {t.sessions} | {t.alone_p50_ms:.0f} | {t.beside_p50_ms:.0f} | "
                  f"{t.beside_p99_ms:.0f} | {t.ratio:.2f} | {t.beside_appends} | {t.prefill_s:.1f} | "
                  f"{t.beside_compute_p99_ms:.0f} |")
            goals[f"{t.stack} ws{t.world_size}: appends' p99 beside a prefill / p50 alone (goal <= 3)"] = t.ratio
    print(f"\nattention paths: {json.dumps(run.attention)}")
    return {k: round(v, 3) for k, v in goals.items()}


def main() -> None:
    d = Sizes()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=list(d.sessions))
    parser.add_argument("--context", type=int, default=d.context)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(d.world_sizes))
    parser.add_argument("--stacks", nargs="+", choices=["transformer", "llama"], default=list(d.stacks))
    parser.add_argument("--rounds", type=int, default=d.rounds, help="timed rounds per S (one step each)")
    parser.add_argument("--prefill-rows", type=int, default=d.prefill_rows, help="the prefill goal's rows; 0: skip")
    parser.add_argument("--stall-rounds", type=int, default=d.stall_rounds, help="rounds of appends alone")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="tunables.gang.session_prefill_chunk_tokens")
    parser.add_argument("--chunk-linger-s", type=float, default=None,
                        help="tunables.gang.session_prefill_chunk_linger_s (0: a chunk never waits)")
    parser.add_argument("--step-ratio", type=float, default=None,
                        help="tunables.gang.session_prefill_step_ratio (0: every chunk --chunk-tokens rows)")
    parser.add_argument("--batch-wait-s", type=float, default=LINGER_S,
                        help="batch_wait_timeout_s: the batcher's wait for company (0: the service's default)")
    parser.add_argument("--attention", choices=["auto", "gather"], default=d.attention,
                        help="tunables.gang.session_attention (gather: the path before the in-place kernel)")
    parser.add_argument("--block-tokens", type=int, default=None,
                        help="session_block_tokens, the KV pages' tokens (default: the service's)")
    parser.add_argument("--threads-per-rank", type=int, default=None,
                        help="torch_threads_per_rank of the served gangs (default: the cores over the world size)")
    parser.add_argument("--in-process", action="store_true",
                        help="first, without the service: each stack's ws1 step in this process, gather and "
                        "in place, at the same S and context (the rows bench/gpu reports for a GPU)")
    parser.add_argument("--no-served", action="store_true", help="skip the served gangs (with --in-process)")
    args = parser.parse_args()
    sizes = Sizes(tuple(args.sessions), args.context, tuple(args.world_sizes), tuple(args.stacks), args.rounds,
                  args.prefill_rows, args.stall_rounds, args.chunk_tokens, args.attention, args.block_tokens,
                  args.threads_per_rank, args.chunk_linger_s, args.batch_wait_s, args.step_ratio)
    local: list[StepRow] = []
    if args.in_process:
        torch.set_num_threads(os.cpu_count() or 1)  # as a ws1 rank here: every core
        for stack in sizes.stacks:
            for in_place in (False, True):
                local += in_process_steps(stack, sizes.sessions, sizes.context, torch.device("cpu"), torch.float32,
                                          sizes.rounds, in_place=in_place,
                                          **({"block": sizes.block_tokens} if sizes.block_tokens else {}))
                print_rows(local[-len(sizes.sessions):])
    run = Run(sizes) if args.no_served else bench_decode(sizes)
    run.rows = local + run.rows
    goals = print_run(run)
    from bench.run import print_ratios

    print_ratios("decode goals", goals)
    out = Path(__file__).resolve().parent / "results" / "decode.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"sizes": asdict(sizes), "rows": [asdict(r) for r in run.rows],
                               "stalls": [asdict(t) for t in run.stalls], "attention": run.attention,
                               "load_average": run.load_average, "goals": goals}, indent=1))


if __name__ == "__main__":
    main()
