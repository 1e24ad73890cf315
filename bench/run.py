"""gangserve benchmark: everything side by side in ONE run, printed as a markdown table.

Serving rows go through port 8000 as `make serve` runs it (the front door: Serve's HAProxy
straight to the replicas' own ports); rows marked "direct ingress" hit an ingress replica's own
port; the front-door section also measures Serve's Python proxy (the old default path), same
cluster, same run.

    make bench            # or: .venv/bin/python bench/run.py [--requests N]

Writes bench/results/latest.json. Compare ratios, not absolute numbers: machines are noisy.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.reference import dense_reference, notes_seed_weights  # noqa: E402

SHAPE = (128, 8, 512)  # the original notes' request


def print_ratios(heading: str, values: dict[str, float]) -> None:
    """A markdown table of named ratios (the README's benchmark tables are pasted from these)."""
    print(f"\n| {heading} | value |")
    print("|---|---:|")
    for name, value in values.items():
        print(f"| {name} | {value:.2f} |")


def percentiles(samples_s: list[float]) -> dict[str, float]:
    """p50 and p99, and the quartiles p25 / p75 (the spread a noisy shared machine leaves)."""
    ms = sorted(s * 1000 for s in samples_s)

    def at(q: float) -> float:
        return ms[min(len(ms) - 1, int(round(q * (len(ms) - 1))))]

    return {"p50_ms": statistics.median(ms), "p99_ms": at(0.99), "p25_ms": at(0.25), "p75_ms": at(0.75), "n": len(ms)}


def spread(r: dict[str, float]) -> str:
    """A row's quartiles, `p25-p75` (rows recorded before they were kept: `-`)."""
    return f"{r['p25_ms']:.1f}-{r['p75_ms']:.1f}" if "p25_ms" in r else "-"


def time_calls(fn: Callable[[], object], n: int, warmup: int = 3) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return percentiles(samples)


def bench_in_process(x: torch.Tensor, n: int) -> dict[str, float]:
    torch.set_num_threads(os.cpu_count() or 1)
    mha = dense_reference(notes_seed_weights(512), 8)

    def call() -> None:
        with torch.inference_mode():
            mha(x, x, x, need_weights=False)

    return time_calls(call, n)


def npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()


def poster(client: httpx.Client, url: str, body: bytes, media: str) -> Callable[[], None]:
    def call() -> None:
        r = client.post(url, content=body, headers={"content-type": media})
        assert r.status_code == 200, r.text[:300]

    return call


def throughput(url: str, body: bytes, media: str, clients: int, seconds: float) -> dict[str, float]:
    """Completed requests per second with `clients` closed-loop clients for `seconds`."""
    stop = time.monotonic() + seconds
    counts = [0] * clients
    latencies: list[float] = []

    def worker(i: int) -> None:
        with httpx.Client(timeout=120) as client:
            call = poster(client, url, body, media)
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                call()
                latencies.append(time.perf_counter() - t0)
                counts[i] += 1

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, range(clients)))
    return {"req_per_s": sum(counts) / seconds, **percentiles(latencies)}


def direct_base(app_name: str, timeout_s: float = 30.0) -> str:
    """`http://host:port` of the app's first direct-ingress HTTP target (an ingress replica's
    own port, not the proxy's), polling the Serve controller for up to `timeout_s`.

    The replica binds the Serve `http_options.host` (127.0.0.1 here) while the target
    reports the node IP, so a specific bind host wins over the target's IP."""
    import ray
    from ray import serve

    controller = serve.context._get_global_client()._controller
    http = ray.get(controller.get_http_config.remote())
    deadline = time.monotonic() + timeout_s
    while True:
        targets = [t for group in ray.get(controller.get_target_groups.remote(app_name))
                   if group.protocol == "HTTP" for t in group.targets]
        if targets and targets[0].port != http.port:
            host = targets[0].ip if http.host in ("0.0.0.0", "::", "") else http.host
            return f"http://{host}:{targets[0].port}"
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"no direct-ingress HTTP target for app {app_name!r} after {timeout_s:.0f}s "
                f"(targets {[(t.ip, t.port) for t in targets]}, proxy port {http.port}); "
                "is RAY_SERVE_ENABLE_DIRECT_INGRESS=1 set before ray.init?")
        time.sleep(0.5)


def time_breakdown(client: httpx.Client, base: str, body: bytes, n: int = 20) -> dict[str, float]:
    """Median split of one gangserve request: the ingress's Server-Timing phases, the
    gang's own step time (/gang), and what is left for the HTTP proxy path."""
    phases: dict[str, list[float]] = {}
    totals = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.post(base + "/infer", content=body, headers={"content-type": "application/x-npy"})
        totals.append((time.perf_counter() - t0) * 1000)
        for part in r.headers["server-timing"].split(","):
            name, dur = part.strip().split(";dur=")
            phases.setdefault(name, []).append(float(dur))
    med = {name: statistics.median(v) for name, v in phases.items()}
    step = client.get(base + "/gang").json()["batching"]["recent_step_ms_p50"]
    total = statistics.median(totals)
    return {
        "client total": total,
        "HTTP proxy path + client (total - ingress)": total - sum(med.values()),
        "ingress: read body": med["read"],
        "ingress: decode + validate": med["decode"],
        "ingress -> rank 0 hop (gang - step)": med["gang"] - step,
        "gang step: broadcast + TP attention + all_reduce": step,
        "ingress: encode reply": med["encode"],
    }


def server_timing(headers: httpx.Headers) -> dict[str, float]:
    out = {}
    for part in headers.get("server-timing", "").split(","):
        if ";dur=" in part:
            name, dur = part.strip().split(";dur=")
            out[name] = float(dur)
    return out


def interleaved(calls: dict[str, Callable[[], httpx.Response]], n: int, warmup: int = 5) -> dict[str, dict]:
    """n rounds over `calls` (so load and noise hit every row alike), each round in a new
    shuffled order: a request right after another deployment's pays for that one's
    after-work (measured: a fixed order favoured whichever row came third by ~2 ms on
    small requests). Each row's p50/p99 and the medians of its Server-Timing phases."""
    import random

    order = random.Random(16)
    for _ in range(warmup):
        for call in calls.values():
            call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    phases: dict[str, dict[str, list[float]]] = {name: {} for name in calls}
    for _ in range(n):
        names = list(calls)
        order.shuffle(names)
        for name in names:
            call = calls[name]
            t0 = time.perf_counter()
            r = call()
            samples[name].append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text[:300]
            for phase, ms in server_timing(r.headers).items():
                phases[name].setdefault(phase, []).append(ms)
    return {name: {**percentiles(samples[name]),
                   "server_timing": {p: statistics.median(v) for p, v in phases[name].items()}}
            for name in calls}


def bench_equal_compute(base: str, n: int, load_s: float) -> dict[str, dict]:
    """Issue 16: gangserve at world size 1 with 2 torch threads next to the naive one-replica
    peer with 2 threads (equal compute, no tensor parallelism), both shapes, interleaved;
    the same gang with same_event_loop off, and with both it and the data channel off (the Serve
    requests at 16 clients; and at world size 2 how far we are from Serve echo + the bare
    2-process TP step."""
    from ray import serve

    from bench.peers import NaivePeer
    from harness.local import local_yaml_args
    from service.app import build_app

    ws1 = {**local_yaml_args(), "world_size": 1, "cpus_per_rank": 2}
    serve.run(NaivePeer.options(ray_actor_options={"num_cpus": 2}).bind(2), name="naive2", route_prefix="/naive2")
    serve.run(build_app(ws1), name="eq_ws1", route_prefix="/eq_ws1")
    serve.run(build_app({**ws1, "same_event_loop": False}), name="eq_ws1t", route_prefix="/eq_ws1t")
    serve.run(build_app({**ws1, "data_channel": False, "same_event_loop": False}), name="eq_ws1h", route_prefix="/eq_ws1h")
    client = httpx.Client(timeout=120)
    rows: dict[str, dict] = {}
    big = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    small = big[:1].copy()
    for label, x in (("notes' shape [128, 8, 512]", big), ("small [1, 8, 512]", small)):
        body = npy(x)
        post = lambda url: (lambda: client.post(url, content=body, headers={"content-type": "application/x-npy"}))  # noqa: E731
        rows[label] = interleaved({
            "naive peer (2 threads)": post(base + "/naive2"),
            "gangserve ws1 (2 threads)": post(base + "/eq_ws1/infer"),
            "gangserve ws1, same_event_loop off": post(base + "/eq_ws1t/infer"),
            "gangserve ws1, same_event_loop and data channel off (handle call)": post(base + "/eq_ws1h/infer"),
        }, n)
    load = {name: throughput(url, npy(small), "application/x-npy", clients=16, seconds=load_s)
            for name, url in (("naive peer (2 threads)", base + "/naive2"),
                              ("gangserve ws1 (2 threads)", base + "/eq_ws1/infer"),
                              ("gangserve ws1, same_event_loop and data channel off (handle call)", base + "/eq_ws1h/infer"))}
    steps = {name: client.get(f"{base}/{app}/gang").json()["batching"] for name, app in
             (("gangserve ws1 (2 threads)", "eq_ws1"), ("gangserve ws1, same_event_loop off", "eq_ws1t"),
              ("gangserve ws1, same_event_loop and data channel off (handle call)", "eq_ws1h"))}
    for app in ("eq_ws1", "eq_ws1t", "eq_ws1h"):
        serve.delete(app)
    ws2 = bench_step_loop(base, client, big, small, n, load_s)
    serve.delete("naive2")
    return {"latency": rows, "small_c16": load, "batching": steps, "ws2": ws2}


WS2_LOOP = "gangserve ws2 (step loop)"


def bench_step_loop(base: str, client: httpx.Client, big: np.ndarray, small: np.ndarray, n: int,
                    load_s: float) -> dict[str, dict]:
    """World size 2 with the peers' step loop, on both shapes, next to Serve echo of the
    same body; the bare 2-process TP step of each shape
    (no service); small requests at 16 clients (against the naive peer, still deployed by
    the caller); and where the loop's steps spend their time (`/gang` step_timings)."""
    from ray import serve

    from bench.bare_tp import bare_step_ms
    from bench.peers import EchoPeer
    from harness.local import local_yaml_args
    from service.app import build_app

    serve.run(EchoPeer.bind(), name="eq_echo", route_prefix="/eq_echo")
    serve.run(build_app(local_yaml_args()), name="eq_ws2", route_prefix="/eq_ws2")
    out: dict[str, dict] = {"latency": {}, "bare": {}}
    for label, x in (("notes' shape [128, 8, 512]", big), ("small [1, 8, 512]", small)):
        body = npy(x)
        post = lambda url: (lambda: client.post(url, content=body, headers={"content-type": "application/x-npy"}))  # noqa: E731
        out["latency"][label] = interleaved({
            "Serve echo (same npy body)": post(base + "/eq_echo"),
            WS2_LOOP: post(base + "/eq_ws2/infer"),
        }, n)
        client.get(base + "/eq_ws2/gang")  # kicks a refresh of the step timings of this shape's steps
        time.sleep(1.0)
        out["latency"][label]["step_timings"] = client.get(base + "/eq_ws2/gang").json().get("step_timings", {})
    out["small_c16"] = {name: throughput(url, npy(small), "application/x-npy", clients=16, seconds=load_s)
                        for name, url in (("naive peer (2 threads)", base + "/naive2"),
                                          (WS2_LOOP, base + "/eq_ws2/infer"))}
    for app in ("eq_echo", "eq_ws2"):
        serve.delete(app)
    # After the apps are gone, so the bare processes have the cores the gang had.
    out["bare"] = {"notes' shape [128, 8, 512]": bare_step_ms(tuple(big.shape)),
                   "small [1, 8, 512]": bare_step_ms(tuple(small.shape), steps=100)}
    return out


def print_latency_rows(latency: dict[str, dict], bare: dict[str, float]) -> None:
    """One markdown row per (request shape, row) with p50, p99 and Server-Timing, and the bare
    2-process TP step of each shape after its rows."""
    print("| request | row | p50 ms | p25-p75 ms | p99 ms | Server-Timing medians (ms) |")
    print("|---|---|---:|---:|---:|---|")
    for label, rows in latency.items():
        for name, r in rows.items():
            if name == "step_timings":
                continue
            timing = ", ".join(f"{k} {v:.1f}" for k, v in r["server_timing"].items()) or "-"
            print(f"| {label} | {name} | {r['p50_ms']:.1f} | {spread(r)} | {r['p99_ms']:.1f} | {timing} |")
        print(f"| {label} | bare 2-process gloo TP step | {bare[label]:.1f} | | | |")


def print_step_timings(latency: dict[str, dict], title: str, ratios: dict[str, float] | None = None) -> None:
    """The step loop's per-step medians from `/gang` step_timings, per request shape: the peers'
    wake-up and skew, then rank 0's step parts (the Server-Timing names); with `ratios`, the
    control cost and the skew are recorded there too."""
    parts = ("header", "broadcast", "compute", "all_reduce", "to_numpy")
    print(f"\n{title}\n")
    print(f"| request | steps | peer wake after header (control cost) | skew | {' | '.join(parts)} |")
    print("|---|---:|---:|---:|" + "---:|" * len(parts))
    for label, rows in latency.items():
        t = rows.get("step_timings") or {}
        if t.get("steps"):
            ms = t.get("parts_ms", {})
            print(f"| {label} | {t['steps']} | {', '.join(f'{w:.2f}' for w in t['peer_wake_ms'])} | "
                  f"{t['skew_ms']:.2f} | " + " | ".join(f"{ms[p]:.2f}" if p in ms else "-" for p in parts) + " |")
            if ratios is not None:
                ratios[f"control cost (peer wake after header), {label}, ms"] = max(t["peer_wake_ms"])
                ratios[f"skew, {label}, ms"] = t["skew_ms"]
        else:
            print(f"| {label} | - ({t}) |" + " |" * (len(parts) + 2))


def print_small_c16(c16: dict[str, dict], load_s: float) -> None:
    print(f"\nsmall requests [1, 8, 512], 16 clients for {load_s:.0f}s\n")
    print("| row | req/s | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|")
    for name, r in c16.items():
        print(f"| {name} | {r['req_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |")


def print_step_loop(ws2: dict[str, dict], load_s: float) -> dict[str, float]:
    print("\nworld size 2: ours vs Serve echo + the bare 2-process TP step, interleaved\n")
    print_latency_rows(ws2["latency"], ws2["bare"])
    ratios: dict[str, float] = {}
    for label, rows in ws2["latency"].items():
        floor = rows["Serve echo (same npy body)"]["p50_ms"] + ws2["bare"][label]
        ratios[f"ws2 step loop: ours - (echo + bare), {label}, ms (goal <= 1.5)"] = rows[WS2_LOOP]["p50_ms"] - floor
    print_step_timings(ws2["latency"], "the step loop's steps, from every rank's timestamps (medians, ms; `/gang` step_timings)")
    c16 = ws2["small_c16"]
    print_small_c16(c16, load_s)
    naive = c16["naive peer (2 threads)"]["req_per_s"]
    ratios["small req/s at 16 clients, ws2 step loop / naive (goal >= 1.2)"] = c16[WS2_LOOP]["req_per_s"] / naive
    return ratios


FD, OLD = "port 8000 (HAProxy front door)", "Serve's Python proxy (the old default path)"


def mixed_front_rows() -> dict[str, dict[int, bytes]]:
    """Issue 44's 16-client mixed-length rows through port 8000: label -> one body per length."""
    return {f"[1, 1..{MIXED_MAX_SEQ}, 512]": mixed_bodies(1, range(1, MIXED_MAX_SEQ + 1)),
            "[2, 100..128, 512]": mixed_bodies(2, range(100, 129))}


def _commit() -> str:
    """The measured tree's commit (with `+` when it has uncommitted changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+" if dirty else head or "unknown"


def fallback_proxy_base() -> str:
    """Serve's Python proxy, which the front door keeps on the head as HAProxy's backup: the
    old default path, measured beside the new one in the same run (harness.local.front_door_env
    chose its port)."""
    return f"http://127.0.0.1:{os.environ['RAY_SERVE_FALLBACK_PROXY_HTTP_PORT']}"


def bench_front_door(base: str, n: int, load_s: float) -> dict[str, Any]:
    """Issue 30: every row through port 8000 as a plain client sends it (HAProxy -> the
    replica's own port), and the same apps through Serve's Python proxy (the old path), one
    Serve instance: Serve echo, the naive one-replica peer (2 threads), gangserve world size 2
    and world size 1 at equal compute (2 threads), both shapes, every round shuffled; the bare
    2-process TP step of each shape after the apps are gone; small requests at 16 clients; and
    16 clients of mixed lengths (steps per request from /gang)."""
    from ray import serve

    from bench.bare_tp import bare_step_ms
    from bench.peers import EchoPeer, NaivePeer
    from harness.local import local_yaml_args
    from service.app import build_app

    serve.run(EchoPeer.bind(), name="f_echo", route_prefix="/f_echo")
    serve.run(NaivePeer.options(ray_actor_options={"num_cpus": 2}).bind(2), name="f_naive", route_prefix="/f_naive")
    serve.run(build_app(local_yaml_args()), name="f_ws2", route_prefix="/f_ws2")
    serve.run(build_app({**local_yaml_args(), "world_size": 1, "cpus_per_rank": 2}), name="f_ws1", route_prefix="/f_ws1")
    old = fallback_proxy_base()
    client = httpx.Client(timeout=120)
    out: dict[str, Any] = {"latency": {}, "old_path": old, "commit": _commit(), "load_average_start": os.getloadavg()}
    big = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    small = big[:1].copy()
    paths = {"echo": "/f_echo", "naive": "/f_naive", "ws2": "/f_ws2/infer", "ws1": "/f_ws1/infer"}
    for label, x in (("notes' shape [128, 8, 512]", big), ("small [1, 8, 512]", small)):
        body = npy(x)
        post = lambda url: (lambda: client.post(url, content=body, headers={"content-type": "application/x-npy"}))  # noqa: E731
        rows = interleaved({f"{what}, {door}": post(root + path) for what, path in paths.items()
                            for door, root in ((FD, base), (OLD, old))}, n)
        client.get(base + "/f_ws2/gang")  # kicks a refresh of the step timings of this shape's steps
        time.sleep(1.0)
        rows["step_timings"] = client.get(base + "/f_ws2/gang").json().get("step_timings", {})
        out["latency"][label] = rows
    sbody = npy(small)
    out["small_c16"] = {f"{what}, {door}": throughput(root + paths[what], sbody, "application/x-npy", clients=16, seconds=load_s)
                        for what in ("naive", "ws2", "ws1") for door, root in ((FD, base), (OLD, old))}
    out["mixed_c16"] = {}
    for label, bodies in mixed_front_rows().items():
        mixed_throughput(base + "/f_ws2/infer", bodies, 16, 1.0)  # warm up: the lengths' first steps
        # The gang's batcher, the one on the path, counts every HTTP request and its own steps.
        before = client.get(base + "/f_ws2/gang").json()["batching"]
        row = out["mixed_c16"][label] = mixed_throughput(base + "/f_ws2/infer", bodies, 16, load_s)
        after = client.get(base + "/f_ws2/gang").json()["batching"]
        row["gang_steps"], row["gang_requests"] = after["steps"] - before["steps"], after["requests"] - before["requests"]
    for app in ("f_echo", "f_naive", "f_ws2", "f_ws1"):
        serve.delete(app)
    out["bare"] = {"notes' shape [128, 8, 512]": bare_step_ms(tuple(big.shape)),
                   "small [1, 8, 512]": bare_step_ms(tuple(small.shape), steps=100)}
    out["load_average"] = os.getloadavg()
    return out


def print_front_door(d: dict[str, Any], load_s: float) -> dict[str, float]:
    """The front-door section's tables and its goals (issue 44's: ws2 - (echo + bare) <= 5 ms on
    the notes' shape and <= 1.5 ms small; small req/s ws2 / naive >= 2; issue 55's: ws1 / naive
    <= 1.05 on the notes' shape, ws1 - naive <= 1.0 ms small)."""
    print(f"\nthe front door (issues 30, 44): port 8000 (Serve's HAProxy straight to the replicas) vs Serve's "
          f"Python proxy, one Serve instance, interleaved, npy; commit {d.get('commit', '?')}; load average "
          f"at the start {', '.join(f'{v:.1f}' for v in d.get('load_average_start', ()))}, at the end "
          f"{', '.join(f'{v:.1f}' for v in d['load_average'])}\n")
    print_latency_rows(d["latency"], d["bare"])
    ratios: dict[str, float] = {}
    for label, rows in d["latency"].items():
        bare = d["bare"][label]
        p50 = {name: r["p50_ms"] for name, r in rows.items() if name != "step_timings"}
        gap_goal = 5.0 if label.startswith("notes'") else 1.5
        for door in (FD, OLD):
            if label.startswith("notes'"):
                ratios[f"ws1 / naive, {label}, {door} (goal <= 1.05)"] = p50[f"ws1, {door}"] / p50[f"naive, {door}"]
            else:
                ratios[f"ws1 - naive, {label}, {door}, ms (goal <= 1.0)"] = p50[f"ws1, {door}"] - p50[f"naive, {door}"]
            ratios[f"ws2: ours - (echo + bare), {label}, {door}, ms (goal <= {gap_goal})"] = (
                p50[f"ws2, {door}"] - p50[f"echo, {door}"] - bare)
    print_step_timings(d["latency"], "the step loop's steps (ws2, medians, ms; `/gang` step_timings)", ratios)
    c16 = d["small_c16"]
    print_small_c16(c16, load_s)
    for door in (FD, OLD):
        ratios[f"small req/s at 16 clients, ws2 / naive, {door} (goal >= 2)"] = (
            c16[f"ws2, {door}"]["req_per_s"] / c16[f"naive, {door}"]["req_per_s"])
    print(f"\n16 clients of mixed lengths, ws2, {FD}, {load_s:.0f}s each\n")
    print("| request shape | req/s | p50 ms | p99 ms | requests | gang steps | steps per request |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, m in d["mixed_c16"].items():
        per = m["gang_steps"] / max(m["gang_requests"], 1)
        print(f"| {label} | {m['req_per_s']:.0f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | {m['gang_requests']} | "
              f"{m['gang_steps']} | {per:.2f} |")
        ratios[f"mixed lengths {label}, 16 clients, {FD}: gang steps per request (goal <= 0.5)"] = per
    print_ratios("front door", ratios)
    return ratios


def print_equal_compute(eq: dict[str, dict], load_s: float) -> dict[str, float]:
    print("\nequal compute (issue 16): gangserve world_size 1, cpus_per_rank 2 (2 torch threads) vs the "
          "naive one-replica peer with 2 threads, npy, interleaved\n")
    print("| request | row | p50 ms | p99 ms | Server-Timing medians (ms) | p50 / naive |")
    print("|---|---|---:|---:|---|---:|")
    ratios: dict[str, float] = {}
    for label, rows in eq["latency"].items():
        naive = rows["naive peer (2 threads)"]["p50_ms"]
        for name, r in rows.items():
            timing = ", ".join(f"{k} {v:.1f}" for k, v in r["server_timing"].items()) or "-"
            print(f"| {label} | {name} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {timing} | {r['p50_ms'] / naive:.2f} |")
        ratios[f"ws1 / naive p50, {label} (goal <= 1.05)"] = rows["gangserve ws1 (2 threads)"]["p50_ms"] / naive
        ratios[f"ws1, same_event_loop off / naive p50, {label}"] = (
            rows["gangserve ws1, same_event_loop off"]["p50_ms"] / naive)
        ratios[f"ws1, both off (the handle call) / naive p50, {label}"] = (
            rows["gangserve ws1, same_event_loop and data channel off (handle call)"]["p50_ms"] / naive)
    print(f"\nsmall requests [1, 8, 512], 16 clients for {load_s:.0f}s\n")
    print("| row | req/s | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|")
    for name, r in eq["small_c16"].items():
        print(f"| {name} | {r['req_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |")
    c16 = eq["small_c16"]
    ratios["small req/s at 16 clients, ws1 / naive (goal >= 1)"] = (
        c16["gangserve ws1 (2 threads)"]["req_per_s"] / c16["naive peer (2 threads)"]["req_per_s"])
    ratios.update(print_step_loop(eq["ws2"], load_s))
    print_ratios("goal", ratios)
    return ratios


def steady_rate(samples_per_epoch: int, epoch_ends: list[float]) -> float:
    """Samples/s over epochs 2..N (the first epoch carries start-up: workers, rendezvous)."""
    if len(epoch_ends) < 2:
        raise ValueError(f"steady state needs at least 2 epochs, got {len(epoch_ends)}")
    return samples_per_epoch * (len(epoch_ends) - 1) / (epoch_ends[-1] - epoch_ends[0])


def run_torchrun_reference(spec_doc: dict, timeout_s: float = 900) -> dict:
    """bench/ddp_torchrun.py under `torchrun --nproc_per_node <world_size>`: the same DDP loop
    on the same model, data, batch and CPUs, without Ray; rank 0's timings."""
    from service.training.spec import JobSpec

    world = JobSpec.model_validate(spec_doc).world_size
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        # `python -m torch.distributed.run` is the `torchrun` console script, with this interpreter.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), str(ROOT / "bench" / "ddp_torchrun.py"),
               "--spec", json.dumps(spec_doc), "--out", str(out)]
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        if run.returncode != 0:
            raise RuntimeError(f"torchrun exited {run.returncode}: {run.stderr[-2000:]}")
        return json.loads(out.read_text())


def bench_training(client: httpx.Client, base: str, token: str, timeout_s: float = 600) -> dict[str, float]:
    """The default DDP job (`POST /train {}`: world_size 2) next to the same DDP loop under
    `torchrun --nproc_per_node 2` (bench/ddp_torchrun.py) and a plain single-process loop on
    the same data, one after the other in this run; plus the time from POST to the first
    reported epoch. Steady state = epochs 2..N: the job's from its history's `at` (when each
    epoch's checkpoint was reported), torchrun's from its rank 0's epoch ends."""
    from torch.utils.data import DataLoader, TensorDataset

    from service.training.datasets import synthetic
    from service.training.models import build_model
    from service.training.runner import vector_sq_error
    from service.training.spec import JobSpec

    spec = JobSpec()
    samples = spec.dataset.samples
    t_post = time.monotonic()
    r = client.post(base + "/train", json={}, headers={"authorization": f"Bearer {token}"})
    assert r.status_code == 202, r.text
    job_url = base + r.headers["location"]
    epoch_times: list[float] = []
    while time.monotonic() - t_post < timeout_s:
        job = client.get(job_url, headers={"authorization": f"Bearer {token}"}).json()
        while len(epoch_times) < len(job["history"]):
            epoch_times.append(time.monotonic())
        if job["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            break
        time.sleep(0.2)
    assert job["status"] == "SUCCEEDED", job
    at = [h.get("at") for h in job["history"]]
    ddp_rate = steady_rate(samples, at if all(isinstance(t, (int, float)) for t in at) else epoch_times)
    done_s = time.monotonic() - t_post

    reference = run_torchrun_reference({})
    torchrun_rate = steady_rate(reference["samples_per_epoch"], reference["epoch_end_s"])

    # Plain loop: same model, data, batch size, optimizer and loss, one process, all cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    x, y = synthetic(spec.model, spec.dataset)
    model = build_model(spec.model, spec.seed)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    loader = DataLoader(TensorDataset(x, y), batch_size=spec.batch_size, shuffle=True)
    t0 = time.perf_counter()
    for _ in range(spec.epochs):
        for xb, yb in loader:
            opt.zero_grad()
            vector_sq_error(model(xb), yb).backward()
            opt.step()
    plain_rate = samples * spec.epochs / (time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return {
        "POST to first epoch s": epoch_times[0] - t_post,
        "POST to SUCCEEDED s": done_s,
        "DDP ws2 job samples/s (epochs 2..N, incl. per-epoch checkpoint)": ddp_rate,
        "same DDP loop under torchrun --nproc_per_node 2 samples/s (epochs 2..N)": torchrun_rate,
        "torchrun: start to end of its first epoch s": reference["epoch_end_s"][0] - reference["start_s"],
        "plain single-process loop samples/s": plain_rate,
    }


def print_training(rows: dict[str, float]) -> dict[str, float]:
    print("\ntraining: the default job (POST /train {}: attention, 1024 samples, world_size 2, 5 epochs)\n")
    print("| measure | value |")
    print("|---|---:|")
    for name, value in rows.items():
        print(f"| {name} | {value:.1f} |")
    ratios = {"DDP job / torchrun samples/s (goal >= 0.85)":
              rows["DDP ws2 job samples/s (epochs 2..N, incl. per-epoch checkpoint)"]
              / rows["same DDP loop under torchrun --nproc_per_node 2 samples/s (epochs 2..N)"]}
    print_ratios("ratio", ratios)
    return ratios


def bench_serving(x: np.ndarray, n: int, load_s: float, only: str | None = None,
                  latency_only: bool = False) -> dict[str, dict]:
    """Serve echo floor, naive dense peer and gangserve (world sizes 1, 2, 4), one cluster;
    echo, naive and gangserve ws2 also through direct ingress (no proxy)."""
    import ray
    from ray import serve

    from bench.peers import EchoPeer, NaivePeer
    from service.app import build_app
    from harness.local import free_port, front_door_env, local_yaml_args
    from service.cluster.front_door import grpc_options

    cores = os.cpu_count() or 1
    # Training jobs need a token and a state dir; set before Ray starts so workers inherit them.
    token = os.environ.setdefault("GANGSERVE_API_TOKEN", "bench-token")
    os.environ.setdefault("GANGSERVE_STATE_DIR", tempfile.mkdtemp(prefix="gangserve-bench-"))
    # The product's front door, as `make serve` starts it (Serve's HAProxy straight to every
    # ingress replica's own port; the Python proxy stays as its backup, measured as the old
    # path). The controller and replicas read it, hence before ray.init.
    os.environ.update(front_door_env())
    # Logical CPUs (threads are set per deployment): room for the equal-compute section's
    # apps side by side. address="local": never attach to another Ray cluster on the machine.
    ray.init(address="local", num_cpus=max(8, cores), include_dashboard=False, log_to_driver=False)
    port, grpc_port = free_port(), free_port()
    # The Open Inference Protocol over gRPC through the same front door (HAProxy's gRPC
    # frontend), as every config in deployments/ serves it; only the grpc section sends to it.
    serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc_options(grpc_port))
    base = f"http://127.0.0.1:{port}"
    results: dict[str, dict] = {"latency": {}, "small": {}, "memory": {}}
    try:
        if only == "gangs":
            results["gangs"] = bench_gangs(httpx.Client(timeout=120), base, x, n, load_s)
            return results
        if only == "mixed":
            results["mixed"] = bench_mixed(base, n, load_s)
            return results
        if only == "train":
            # The default app (its JobManager runs the job; its gang idles, as in the full run).
            serve.run(build_app(local_yaml_args()), name="gangserve", route_prefix="/")
            results["training"] = bench_training(httpx.Client(timeout=120), base, token)
        if only == "rebuild":
            results["rebuild"] = bench_rebuild(base)
            return results
        if only == "front":
            results["front"] = bench_front_door(base, n, load_s)
            return results
        if only == "sessions":
            from bench.sessions import bench_sessions

            serve.run(build_app({**local_yaml_args(), "init": "random", "batch_wait_timeout_s": 0.005}),
                      name="gangserve", route_prefix="/")
            results["sessions"] = bench_sessions(base, n)
            serve.delete("gangserve")  # the in-process part below wants the cores to itself
            from bench.paged import bench_paged

            results["sessions"]["paged"] = bench_paged()  # issue 52: gather vs in place, chunks, cold start
            return results
        if only == "models":
            results["models"] = bench_models(base, latency_only=latency_only)
            return results
        if only == "grpc":
            from bench.grpc_oip import bench_grpc

            results["grpc"] = bench_grpc(base, f"127.0.0.1:{grpc_port}", n, load_s)
            return results
        if only == "steploop":
            from bench.peers import NaivePeer as _Naive

            serve.run(_Naive.options(ray_actor_options={"num_cpus": 2}).bind(2), name="naive2", route_prefix="/naive2")
            big = x.astype(np.float32)
            results["steploop"] = bench_step_loop(base, httpx.Client(timeout=120), big, big[:1].copy(), n, load_s)
            serve.delete("naive2")
            return results
        results["equal"] = bench_equal_compute(base, n, load_s)
        if only == "equal":
            return results
        results["front"] = bench_front_door(base, n, load_s)
        serve.run(EchoPeer.bind(), name="echo", route_prefix="/echo")
        serve.run(NaivePeer.options(ray_actor_options={"num_cpus": cores}).bind(cores), name="naive", route_prefix="/naive")
        # The JSON row sends the notes' shape as JSON text (10.8 MB), over the default
        # max_json_bytes (8 MiB): this app allows 16 MiB so that row can be measured.
        serve.run(build_app({**local_yaml_args(), "max_json_bytes": 16 * 2**20}), name="gangserve", route_prefix="/")
        # Lever A/Bs in the same run: the same gang with dynamic batching off (in the
        # ingress and in the gang server), and with the /dev/shm tensor hand-off off.
        serve.run(build_app({**local_yaml_args(), "max_batch_size": 1, "cpus_per_rank": 0.25}),
                  name="nobatch", route_prefix="/nobatch")
        serve.run(build_app({**local_yaml_args(), "shm_transport": False, "cpus_per_rank": 0.25}),
                  name="noshm", route_prefix="/noshm")
        client = httpx.Client(timeout=120)
        echo_d, naive_d, gang_d, nobatch_d = (direct_base(app) for app in ("echo", "naive", "gangserve", "nobatch"))
        results["direct_ingress"] = {"echo": echo_d, "naive": naive_d, "gangserve": gang_d}
        from safetensors.numpy import save as st_save

        lat = results["latency"]
        lat["Serve echo floor (2 MiB npy body)"] = time_calls(poster(client, base + "/echo", npy(x), "application/x-npy"), n)
        lat["naive peer: dense MHA in one replica (npy)"] = time_calls(poster(client, base + "/naive", npy(x), "application/x-npy"), n)
        lat["gangserve ws2 npy"] = time_calls(poster(client, base + "/infer", npy(x), "application/x-npy"), n)
        lat["gangserve ws2 npy, shm_transport off (object store)"] = time_calls(
            poster(client, base + "/noshm/infer", npy(x), "application/x-npy"), n)
        lat["gangserve ws2 safetensors"] = time_calls(
            poster(client, base + "/infer", st_save({"hidden_states": x}), "application/x-safetensors"), n)
        body_json = json.dumps({"hidden_states": x.tolist()}).encode()
        lat["gangserve ws2 json (max_json_bytes 16 MiB)"] = time_calls(poster(client, base + "/infer", body_json, "application/json"), max(5, n // 4))
        # The route prefix stays part of the path on the direct port.
        lat["Serve echo floor (2 MiB npy body), direct ingress"] = time_calls(
            poster(client, echo_d + "/echo", npy(x), "application/x-npy"), n)
        lat["naive peer: dense MHA in one replica (npy), direct ingress"] = time_calls(
            poster(client, naive_d + "/naive", npy(x), "application/x-npy"), n)
        lat["gangserve ws2 npy, direct ingress"] = time_calls(
            poster(client, gang_d + "/infer", npy(x), "application/x-npy"), n)

        results["breakdown"] = time_breakdown(client, base, npy(x))
        small = np.random.default_rng(0).standard_normal((1, 8, 512), dtype=np.float32)
        peers = (("naive peer", base + "/naive"), ("gangserve ws2", base + "/infer"),
                 ("gangserve ws2, batching off (max_batch_size=1)", base + "/nobatch/infer"),
                 ("naive peer, direct ingress", naive_d + "/naive"), ("gangserve ws2, direct ingress", gang_d + "/infer"),
                 ("gangserve ws2, batching off, direct ingress", nobatch_d + "/nobatch/infer"))
        for name, url in peers:
            seq = time_calls(poster(client, url, npy(small), "application/x-npy"), n)
            load = throughput(url, npy(small), "application/x-npy", clients=16, seconds=load_s)
            results["small"][name] = {"seq_p50_ms": seq["p50_ms"], "seq_p99_ms": seq["p99_ms"], **{f"c16_{k}": v for k, v in load.items()}}
        serve.delete("nobatch")  # free their CPUs for the training job
        serve.delete("noshm")
        results["training"] = bench_training(client, base, token)
        results["memory"]["2"] = client.get(base + "/gang").json()["param_bytes_per_rank"]
        results["batching"] = client.get(base + "/gang").json()["batching"]
        serve.delete("gangserve")
        for ws in (1, 4):
            args = {**local_yaml_args(), "world_size": ws, "cpus_per_rank": 0.5 if ws == 1 else 0.25}
            serve.run(build_app(args), name=f"ws{ws}", route_prefix=f"/ws{ws}")
            results["memory"][str(ws)] = client.get(f"{base}/ws{ws}/gang").json()["param_bytes_per_rank"]
            serve.delete(f"ws{ws}")
        results["gangs"] = bench_gangs(client, base, x, n, load_s)
        results["mixed"] = bench_mixed(base, n, load_s)
        results["rebuild"] = bench_rebuild(base)
        return results
    finally:
        serve.shutdown()
        ray.shutdown()


MIXED_MAX_SEQ = 128  # issue 22: sequence lengths spread over 1..128, batch 1 each


def mixed_bodies(rows: int, lengths: range, seed: int = 5) -> dict[int, bytes]:
    """One npy body [rows, s, 512] float32 per sequence length s (built before any load runs:
    the load generator only sends)."""
    rng = np.random.default_rng(seed)
    return {s: npy(rng.standard_normal((rows, s, 512), dtype=np.float32)) for s in lengths}


def mixed_throughput(url: str, bodies: dict[int, bytes], clients: int, seconds: float) -> dict[str, float]:
    """Completed requests per second with `clients` closed-loop clients for `seconds`, each
    request one of `bodies` (mixed_bodies: [rows, s, 512] npy), s drawn uniformly from its
    lengths (one fixed sequence per client); tokens/s counts s per request."""
    import random

    stop = time.monotonic() + seconds
    counts = [0] * clients
    tokens = [0] * clients
    latencies: list[float] = []
    lengths = sorted(bodies)

    def worker(i: int) -> None:
        rng = random.Random(1000 + i)
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < stop:
                seq = rng.choice(lengths)
                t0 = time.perf_counter()
                r = client.post(url, content=bodies[seq], headers={"content-type": "application/x-npy"})
                assert r.status_code == 200, r.text[:300]
                latencies.append(time.perf_counter() - t0)
                counts[i] += 1
                tokens[i] += seq

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, range(clients)))
    return {"req_per_s": sum(counts) / seconds, "tokens_per_s": sum(tokens) / seconds, **percentiles(latencies)}


def bench_mixed(base: str, n: int, load_s: float) -> dict[str, dict]:
    """Issue 22: mixed-length traffic (16 clients, seq 1..128, batch 1) on world-size-2 gangs,
    one run: mixed-length batching (default max_padding_fraction 0.25; and 0.5) vs batching
    limited to equal lengths (max_padding_fraction=0), through the proxy and on direct
    ingress; plus the masked request's latency next to the unmasked one's at equal shape."""
    from ray import serve
    from safetensors.numpy import save as st_save

    from harness.local import local_yaml_args
    from service.app import build_app

    # 16 clients with bodies up to 256 KiB: room for all of them in the decoding pool (both apps alike).
    common = {**local_yaml_args(), "cpus_per_rank": 0.5, "max_pending_decodes": 32}
    serve.run(build_app(common), name="mixed", route_prefix="/mixed")
    serve.run(build_app({**common, "max_padding_fraction": 0.0}),
              name="equalonly", route_prefix="/equalonly")
    serve.run(build_app({**common, "max_padding_fraction": 0.5}), name="mixed50", route_prefix="/mixed50")
    client = httpx.Client(timeout=120)
    rng = np.random.default_rng(5)
    bodies = mixed_bodies(1, range(1, MIXED_MAX_SEQ + 1))
    direct = {app: direct_base(app) for app in ("mixed", "equalonly", "mixed50")}
    rows: dict[str, dict] = {}
    for label, app, url in (
        ("mixed-length batching", "mixed", base + "/mixed/infer"),
        ("equal lengths only (max_padding_fraction=0)", "equalonly", base + "/equalonly/infer"),
        ("mixed-length batching, direct ingress", "mixed", direct["mixed"] + "/mixed/infer"),
        ("equal lengths only, direct ingress", "equalonly", direct["equalonly"] + "/equalonly/infer"),
        ("mixed-length batching, max_padding_fraction=0.5, direct ingress", "mixed50", direct["mixed50"] + "/mixed50/infer"),
    ):
        mixed_throughput(url, bodies, 16, 1.0)  # warm up: the lengths' first steps
        before = client.get(f"{base}/{app}/gang").json()
        rows[label] = mixed_throughput(url, bodies, 16, load_s)
        after = client.get(f"{base}/{app}/gang").json()
        # The batching happens once, in the gang server: it sees every request.
        b0, b1 = before["batching"], after["batching"]
        steps = max(b1["steps"] - b0["steps"], 1)
        rows[label]["gang_requests_per_step"] = (b1["requests"] - b0["requests"]) / steps
        rows[label]["gang_padded_token_share"] = (b1["padded_tokens"] - b0["padded_tokens"]) / max(
            b1["tokens"] - b0["tokens"], 1)
    serve.delete("mixed50")
    mixed_d = direct["mixed"]
    # The mask's cost at equal shape: [1, 64, 512] safetensors, one padded position (an
    # all-ones mask is dropped to the unmasked path), interleaved with the unmasked request.
    x = rng.standard_normal((1, 64, 512), dtype=np.float32)
    mask = np.ones((1, 64), dtype=np.int64)
    mask[0, -1] = 0
    plain, masked = st_save({"hidden_states": x}), st_save({"hidden_states": x, "attention_mask": mask})
    st = {"content-type": "application/x-safetensors"}
    latency = interleaved({
        "unmasked [1, 64, 512]": lambda: client.post(mixed_d + "/mixed/infer", content=plain, headers=st),
        "masked [1, 64, 512] (one padded position)": lambda: client.post(mixed_d + "/mixed/infer", content=masked, headers=st),
        "causal [1, 64, 512]": lambda: client.post(mixed_d + "/mixed/infer?causal=true", content=plain, headers=st),
    }, n)
    serve.delete("mixed")
    serve.delete("equalonly")
    return {"throughput": rows, "latency": latency}


def print_mixed(mixed: dict[str, dict], load_s: float) -> dict[str, float]:
    print(f"\nmixed-length traffic (issue 22): 16 clients, batch 1, seq uniform over 1..{MIXED_MAX_SEQ}, "
          f"world size 2, {load_s:.0f}s each, one run\n")
    print("| row | req/s | tokens/s | p50 ms | p99 ms | requests per gang step | padded share |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in mixed["throughput"].items():
        print(f"| {name} | {r['req_per_s']:.0f} | {r['tokens_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
              f"{r['gang_requests_per_step']:.2f} | {r['gang_padded_token_share']:.3f} |")
    print("\n| request (direct ingress, interleaved) | p50 ms | p99 ms | gang ms (Server-Timing) |")
    print("|---|---:|---:|---:|")
    for name, r in mixed["latency"].items():
        print(f"| {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['server_timing'].get('gang', 0):.2f} |")
    t, lat = mixed["throughput"], mixed["latency"]
    ratios = {
        "mixed / equal-only req/s, proxy (goal >= 2)":
            t["mixed-length batching"]["req_per_s"] / t["equal lengths only (max_padding_fraction=0)"]["req_per_s"],
        "mixed / equal-only req/s, direct ingress (goal >= 2)":
            t["mixed-length batching, direct ingress"]["req_per_s"] / t["equal lengths only, direct ingress"]["req_per_s"],
        "mixed (max_padding_fraction=0.5) / equal-only req/s, direct ingress":
            t["mixed-length batching, max_padding_fraction=0.5, direct ingress"]["req_per_s"]
            / t["equal lengths only, direct ingress"]["req_per_s"],
        "masked / unmasked p50 at [1, 64, 512] (goal <= 1.05)":
            lat["masked [1, 64, 512] (one padded position)"]["p50_ms"] / lat["unmasked [1, 64, 512]"]["p50_ms"],
        "causal / unmasked p50 at [1, 64, 512]":
            lat["causal [1, 64, 512]"]["p50_ms"] / lat["unmasked [1, 64, 512]"]["p50_ms"],
    }
    print_ratios("goal", ratios)
    return ratios


def bench_gangs(client: httpx.Client, base: str, x: np.ndarray, n: int, load_s: float) -> dict[str, dict]:
    """1 gang vs 2 gangs (num_replicas) of world size 2, one after the other on the same
    cluster: notes'-shape latency, small-request throughput at 16 clients, and how the
    handle calls split over the gangs."""
    from ray import serve

    from harness.local import local_yaml_args
    from service.app import build_app

    rows: dict[str, dict] = {}
    small = np.random.default_rng(0).standard_normal((1, 8, 512), dtype=np.float32)
    for gangs in (1, 2):
        name = f"gangs{gangs}"
        serve.run(build_app({**local_yaml_args(), "num_replicas": gangs, "cpus_per_rank": 0.25}),
                  name=name, route_prefix=f"/{name}")
        url = f"{base}/{name}"
        deadline = time.monotonic() + 120
        while client.get(url + "/gangs").json()["ready"] < gangs and time.monotonic() < deadline:
            time.sleep(0.5)
        before = {g["replica_id"]: g["batching"]["requests"] for g in client.get(url + "/gangs").json()["gangs"]}
        lat = time_calls(poster(client, url + "/infer", npy(x), "application/x-npy"), n)
        load = throughput(url + "/infer", npy(small), "application/x-npy", clients=16, seconds=load_s)
        time.sleep(2.5)  # a gang report interval (1 s) and then some: /gangs has the final counts
        after = {g["replica_id"]: g["batching"]["requests"] for g in client.get(url + "/gangs").json()["gangs"]}
        split = sorted((after[r] - before.get(r, 0) for r in after), reverse=True)
        rows[f"{gangs} gang{'s' if gangs > 1 else ''} x ws2"] = {
            "p50_ms": lat["p50_ms"], "req_per_s": load["req_per_s"], "per_gang_req_per_s": load["req_per_s"] / gangs,
            "c16_p99_ms": load["p99_ms"], "handle_calls_per_gang": split,
        }
        serve.delete(name)
    return rows


def bench_rebuild(base: str, rounds: int = 3, clients: int = 4) -> dict[str, dict]:
    """kill -9 of rank 1 under load, `rounds` times per app, with and without the warm spare
    (two world-size-2 apps side by side, same cluster, same run): the time from the kill until
    /gang is ready again with a new rank 1 (polled every 20 ms) and until the load's first
    200 after its last failure, plus the rebuild's stages (GET /gang last_bring_up)."""
    import signal
    import threading

    from ray import serve

    from harness.local import local_yaml_args
    from service.app import build_app

    small = npy(np.random.default_rng(0).standard_normal((1, 4, 512), dtype=np.float32))
    client = httpx.Client(timeout=60)
    rows: dict[str, dict] = {}
    for spare in (True, False):
        name = "spare" if spare else "nospare"
        serve.run(build_app({**local_yaml_args(), "cpus_per_rank": 0.25, "collective_timeout_s": 5.0,
                             "warm_spare": spare}), name=name, route_prefix=f"/{name}")
        url = f"{base}/{name}"
        ready_s, served_s, stages = [], [], []
        for _ in range(rounds):
            deadline = time.monotonic() + 120
            while True:  # ready, and (with the spare) the spare warm: the state a loss finds
                info = client.get(url + "/gang").json()
                if info.get("state") == "ready" and (not spare or info["spare"]["state"] == "warm"):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: not ready with a warm spare after 120 s: {info}")
                time.sleep(0.2)
            victim = info["ranks"][1]["pid"]
            outcomes: list[tuple[float, float, int]] = []  # (sent, answered, status)
            stop = threading.Event()

            def load() -> None:
                with httpx.Client(timeout=60) as c:
                    while not stop.is_set():
                        t0 = time.monotonic()
                        try:
                            status = c.post(url + "/infer", content=small,
                                            headers={"content-type": "application/x-npy"}).status_code
                        except httpx.HTTPError:
                            status = -1
                        outcomes.append((t0, time.monotonic(), status))
                        if status != 200:
                            time.sleep(0.01)

            threads = [threading.Thread(target=load, daemon=True) for _ in range(clients)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            while True:
                info = client.get(url + "/gang").json()
                if info.get("state") == "ready" and info["ranks"][1]["pid"] != victim:
                    ready_s.append(time.monotonic() - killed)
                    break
                if time.monotonic() - killed > 120:
                    raise RuntimeError(f"{name}: not rebuilt 120 s after the kill: {info}")
                time.sleep(0.02)
            time.sleep(1.0)
            stop.set()
            for t in threads:
                t.join(timeout=60)
            failed = [sent for sent, _, status in outcomes if status != 200 and sent >= killed - 0.5]
            back = [done for sent, done, status in outcomes if status == 200 and failed and sent > max(failed)]
            served_s.append((min(back) - killed) if back else float("nan"))
            stages.append(info["last_bring_up"])
        rows[name] = {"ready_s": ready_s, "served_s": served_s, "stages": stages,
                      "ready_median_s": statistics.median(ready_s), "served_median_s": statistics.median(served_s)}
        serve.delete(name)
    return rows


def print_rebuild(rows: dict[str, dict]) -> dict[str, float]:
    print("\nkill -9 of rank 1 under load (4 clients), world size 2, one run: medians of the rounds\n")
    print("| rebuild | kill -> /gang ready s | kill -> load served again s | rounds (ready s) | last rebuild's stages ms |")
    print("|---|---:|---:|---|---|")
    for name, r in rows.items():
        label = "warm spare adopted" if name == "spare" else "new process (warm_spare: false)"
        print(f"| {label} | {r['ready_median_s']:.2f} | {r['served_median_s']:.2f} | "
              f"{', '.join(f'{v:.2f}' for v in r['ready_s'])} | {r['stages'][-1]['ms']} |")
    ratios = {
        "warm spare: kill -> ready s (goal <= 1.5)": rows["spare"]["ready_median_s"],
        "ready: new process / warm spare": rows["nospare"]["ready_median_s"] / rows["spare"]["ready_median_s"],
        "served again: new process / warm spare": rows["nospare"]["served_median_s"] / rows["spare"]["served_median_s"],
    }
    print_ratios("rebuild", ratios)
    return ratios


def bench_codecs(x: np.ndarray, n: int = 50) -> dict[str, dict[str, float]]:
    """Encode + decode of one tensor per wire codec (gangserve_client.codecs, the service's and the
    client's one implementation), printed side by side.

    "decode" is what the ingress does to a request body, "encode" what it does to a reply;
    JSON is timed with fewer repetitions (it is ~1000x slower).
    """
    from gangserve_client import codecs

    cases = {
        "safetensors": (lambda a: codecs.encode_safetensors({"hidden_states": a}), codecs.decode_safetensors, n),
        "npy": (codecs.encode_npy, codecs.decode_npy, n),
        "json (orjson + numpy)": (lambda a: codecs.encode_json(a, name="hidden_states"), codecs.decode_json, max(3, n // 10)),
    }
    rows = {}
    for name, (encode, decode, reps) in cases.items():
        body = encode(x)
        assert np.array_equal(decode(body), x)
        enc, dec = time_calls(lambda: encode(x), reps), time_calls(lambda: decode(body), reps)
        both = time_calls(lambda: decode(encode(x)), reps)
        rows[name] = {"encode_ms": enc["p50_ms"], "decode_ms": dec["p50_ms"], "total_ms": both["p50_ms"],
                      "bytes": len(body)}
    print(f"\ncodecs, one {list(x.shape)} {x.dtype} tensor (p50 of {n} runs; JSON {max(3, n // 10)})\n")
    print("| codec | encode ms | decode ms | encode+decode ms | bytes |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['encode_ms']:.3f} | {r['decode_ms']:.3f} | {r['total_ms']:.3f} | {r['bytes']:,} |")
    return rows


def _print_grpc(rows: dict[str, Any], load_s: float) -> dict[str, float]:
    from bench.grpc_oip import print_grpc

    return print_grpc(rows, load_s)


def _print_sessions(rows: dict[str, Any]) -> dict[str, float]:
    from bench.sessions import print_sessions

    return print_sessions(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=30, help="timed requests per latency row")
    parser.add_argument("--load-seconds", type=float, default=5.0, help="duration of each 16-client load run")
    parser.add_argument("--only", choices=["gangs", "equal", "mixed", "steploop", "front", "train", "rebuild",
                                           "sessions", "models", "grpc"],
                        default=None,
                        help="run one section alone (gangs: 1 vs 2 gangs; equal: ws1 vs the naive peer "
                        "at equal compute; mixed: mixed-length batching vs equal lengths only, and the "
                        "mask's latency; steploop: world size 2 with the peers' step loop, "
                        "against Serve echo + the bare TP step, also part of equal; front: port 8000 (HAProxy) "
                        "vs Serve's Python proxy, ws2 and ws1, against echo + bare and the naive peer; train: the default DDP job vs the same "
                        "loop under torchrun --nproc_per_node 2; rebuild: kill -9 of rank 1 with "
                        "and without the warm spare; sessions: appends at context 16 vs 2048, vs the stateless "
                        "causal resend, and 32 concurrent sessions; models: the transformer stacks (4 layers E=512, "
                        "12 layers E=768) at world sizes 1 and 2 beside the naive peer running the same dense "
                        "module, and session appends vs the causal resend on the 12-layer stack; grpc: the Open Inference "
                        "Protocol over gRPC vs HTTP with binary payloads, p50 per shape and 16 clients of small "
                        "requests) and print its table")
    parser.add_argument("--models-latency-only", action="store_true",
                        help="with --only models: the 12-layer stack's latency rows alone (no 4-layer stack, no sessions)")
    args = parser.parse_args()
    torch.manual_seed(42)
    x = torch.randn(*SHAPE)
    # One section alone: (the key bench_serving returns it under, how it is printed: its ratios
    # or None, whether those are goals to print again at the end); written to results/<only>.json.
    load_s = args.load_seconds
    sections: dict[str, tuple[str, Any, bool]] = {
        "gangs": ("gangs", lambda rows: print_gangs(rows, load_s), False),
        "equal": ("equal", lambda rows: print_equal_compute(rows, load_s), False),
        "mixed": ("mixed", lambda rows: print_mixed(rows, load_s), False),
        "steploop": ("steploop", lambda rows: print_step_loop(rows, load_s), True),
        "front": ("front", lambda rows: print_front_door(rows, load_s), True),
        "train": ("training", print_training, False),
        "rebuild": ("rebuild", print_rebuild, False),
        "sessions": ("sessions", _print_sessions, True),
        "models": ("models", print_models, True),
        "grpc": ("grpc", lambda rows: _print_grpc(rows, load_s), True),
    }
    if args.only is not None:
        key, show, goals_again = sections[args.only]
        rows = bench_serving(x.numpy(), args.requests, load_s, only=args.only,
                             latency_only=args.models_latency_only)[key]
        ratios = show(rows)
        if goals_again:
            print_ratios("goal", ratios)
        out = ROOT / "bench" / "results" / f"{args.only}.json"
        out.write_text(json.dumps({key: rows, "ratios": ratios, "time": time.time()}, indent=2))
        print(f"\nwritten to {out.relative_to(ROOT)}")
        return
    codec_rows = bench_codecs(x.numpy())
    dense = bench_in_process(x, args.requests)
    serving = bench_serving(x.numpy(), args.requests, args.load_seconds)
    lat = {"in-process dense nn.MultiheadAttention (all cores)": dense, **serving["latency"]}

    floor = dense["p50_ms"]
    echo = serving["latency"]["Serve echo floor (2 MiB npy body)"]["p50_ms"]
    naive = serving["latency"]["naive peer: dense MHA in one replica (npy)"]["p50_ms"]
    ours = serving["latency"]["gangserve ws2 npy"]["p50_ms"]
    echo_d = serving["latency"]["Serve echo floor (2 MiB npy body), direct ingress"]["p50_ms"]
    naive_d = serving["latency"]["naive peer: dense MHA in one replica (npy), direct ingress"]["p50_ms"]
    ours_d = serving["latency"]["gangserve ws2 npy, direct ingress"]["p50_ms"]
    print(f"\nnotes' shape {list(SHAPE)} float32, {os.cpu_count()} cores, {platform.machine()}, {args.requests} requests per row\n")
    print("| path | p50 ms | p99 ms | p50 / in-process |")
    print("|---|---:|---:|---:|")
    for name, r in lat.items():
        print(f"| {name} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['p50_ms'] / floor:.2f} |")
    small = serving["small"]
    print(f"\nsmall requests [1, 8, 512]: sequential, then 16 concurrent clients for {args.load_seconds:.0f}s\n")
    print("| peer | sequential p50 ms | 16 clients req/s | 16 clients p50 ms | 16 clients p99 ms |")
    print("|---|---:|---:|---:|---:|")
    for name, r in small.items():
        print(f"| {name} | {r['seq_p50_ms']:.1f} | {r['c16_req_per_s']:.0f} | {r['c16_p50_ms']:.1f} | {r['c16_p99_ms']:.1f} |")
    print("\n| world size | attention parameter bytes per rank |")
    print("|---:|---|")
    for ws, per_rank in sorted(serving["memory"].items(), key=lambda kv: int(kv[0])):
        print(f"| {ws} | {', '.join(f'{b / 2**20:.2f} MiB' for b in per_rank)} |")
    print("\nwhere one gangserve ws2 npy request spends its time (medians, ms)\n")
    print("| part | ms |")
    print("|---|---:|")
    for name, ms in serving["breakdown"].items():
        print(f"| {name} | {ms:.1f} |")
    training_ratios = print_training(serving["training"])
    print_gangs(serving["gangs"], args.load_seconds)
    equal_ratios = print_equal_compute(serving["equal"], args.load_seconds)
    mixed_ratios = print_mixed(serving["mixed"], args.load_seconds)
    rebuild_ratios = print_rebuild(serving["rebuild"])
    front_ratios = print_front_door(serving["front"], args.load_seconds)
    goals = {
        "gangserve p50 / naive p50 (goal <= 1)": ours / naive,
        "gangserve p50 / (echo + in-process) (goal <= 1)": ours / (echo + floor),
        "small-request throughput gangserve / naive (goal >= 2)": small["gangserve ws2"]["c16_req_per_s"] / small["naive peer"]["c16_req_per_s"],
        "direct ingress: gangserve p50 / naive p50 (goal <= 1)": ours_d / naive_d,
        "direct ingress: gangserve p50 / (echo + in-process) (goal <= 1)": ours_d / (echo_d + floor),
        "direct ingress: small-request throughput gangserve / naive (goal >= 2)":
            small["gangserve ws2, direct ingress"]["c16_req_per_s"] / small["naive peer, direct ingress"]["c16_req_per_s"],
        **training_ratios,
    }
    print_ratios("ratio", goals)
    out = ROOT / "bench" / "results" / "latest.json"
    out.write_text(json.dumps({"shape": SHAPE, "latency": lat, "small": small, "memory": serving["memory"], "gangs": serving["gangs"], "breakdown": serving["breakdown"], "training": serving["training"],
                               "direct_ingress": serving["direct_ingress"], "ratios": goals,
                               "equal": serving["equal"], "equal_ratios": equal_ratios, "mixed": serving["mixed"],
                               "mixed_ratios": mixed_ratios, "rebuild": serving["rebuild"], "rebuild_ratios": rebuild_ratios,
                               "front": serving["front"], "front_ratios": front_ratios,
                               "codecs": codec_rows, "time": time.time()}, indent=2))
    print(f"\nwritten to {out.relative_to(ROOT)}")


# -- issue 41 item 7: model=transformer stacks, each beside the naive peer running the same
# dense torch module (bench.peers.NaivePeer through the model's dense_forward) -------------
MODEL_STACKS: dict[str, dict[str, Any]] = {
    "4-layer E=512": {"model": "transformer", "num_layers": 4, "embed_dim": 512, "num_heads": 8, "ffn_dim": 2048},
    "12-layer E=768 (GPT-2 small)": {"model": "transformer", "num_layers": 12, "embed_dim": 768, "num_heads": 12,
                                     "ffn_dim": 3072, "activation": "gelu", "norm_first": True},
}
# Rounds per request shape (each round: every row once, shuffled) and warm-up rounds: a
# 12-layer [4, 128, 768] step takes ~0.4 s on 2 CPU cores, ~1 s served beside the others.
MODEL_ROUNDS = {1: (12, 2), 4: (8, 1)}
MODEL_SESSION_STACK = "12-layer E=768 (GPT-2 small)"
M_NAIVE, M_WS1, M_WS2 = "naive peer (2 threads)", "gangserve ws1 (2 threads)", "gangserve ws2 (1 thread per rank)"


def bench_models(base: str, latency_only: bool = False) -> dict[str, Any]:
    """Issue 41 item 7: each stack of MODEL_STACKS served by gangserve at world size 1 with 2
    torch threads (equal compute) and at world size 2 (1 thread per rank), beside the naive
    one-replica peer running the stack's own dense torch module with 2 threads, through the
    front door, interleaved per request shape ([1, 128, E] and [4, 128, E]); on the 12-layer
    stack's ws2 gang, one-row session appends at context 2048 against resending the
    2049-row sequence with causal=true (bench.sessions.append_vs_resend). One stack's apps at
    a time (the cores are shared). `latency_only`: the 12-layer stack's latency rows alone (no
    4-layer stack, no sessions), for a quick look on a busy machine."""
    from ray import serve

    from bench.peers import NaivePeer
    from bench.sessions import append_vs_resend
    from harness.local import local_yaml_args

    from service.app import build_app

    client = httpx.Client(timeout=600)
    out: dict[str, Any] = {"load_average_start": os.getloadavg(), "latency": {}}
    stacks = {MODEL_SESSION_STACK: MODEL_STACKS[MODEL_SESSION_STACK]} if latency_only else MODEL_STACKS
    for stack, arch in stacks.items():
        model = {**arch, "init": "random", "seed": 0}
        e = arch["embed_dim"]
        # A 2049-row causal step of the 12-layer stack takes ~15 s here: room for it (within the
        # default request_timeout_s, 120 s, which must stay below the ingress's drain timeout); the K/V
        # cache of 2 * 12 layers * E/p * 4 bytes per token for ~2100 tokens (~155 MB at ws1).
        common = {**local_yaml_args(), **model, "collective_timeout_s": 110, "session_cache_bytes": 512 * 2**20}
        apps = {M_NAIVE: ("m_naive", f"{base}/m_naive"), M_WS1: ("m_ws1", f"{base}/m_ws1/infer"),
                M_WS2: ("m_ws2", f"{base}/m_ws2/infer")}
        serve.run(NaivePeer.options(ray_actor_options={"num_cpus": 2}).bind(2, model), name="m_naive",
                  route_prefix="/m_naive")
        serve.run(build_app({**common, "world_size": 1, "cpus_per_rank": 2}), name="m_ws1", route_prefix="/m_ws1")
        serve.run(build_app(common), name="m_ws2", route_prefix="/m_ws2")
        rng = np.random.default_rng(0)
        for batch, (rounds, warmup) in MODEL_ROUNDS.items():
            body = npy(rng.standard_normal((batch, 128, e), dtype=np.float32))  # built before any call
            post = lambda url: (lambda: client.post(url, content=body, headers={"content-type": "application/x-npy"}))  # noqa: E731
            label = f"{stack}, [{batch}, 128, {e}]"
            out["latency"][label] = interleaved({name: post(url) for name, (_, url) in apps.items()}, rounds, warmup)
        if stack == MODEL_SESSION_STACK and not latency_only:
            out["sessions"] = {"stack": stack, "world_size": 2, **append_vs_resend(f"{base}/m_ws2", e)}
            out["sessions"]["attention"] = client.get(f"{base}/m_ws2/gang").json()["sessions"]["attention"]
        for app, _ in apps.values():
            serve.delete(app)
        if stack == MODEL_SESSION_STACK and not latency_only:  # issue 52's before: the same gang with its attention gathered
            serve.run(build_app({**common, "tunables": {"gang": {"session_attention": "gather"}}}),
                      name="m_ws2_gather", route_prefix="/m_ws2_gather")
            out["sessions_gather"] = append_vs_resend(f"{base}/m_ws2_gather", e, resends=1)
            serve.delete("m_ws2_gather")
    out["load_average_end"] = os.getloadavg()
    out["commit"] = _commit()
    return out


def print_models(d: dict[str, Any]) -> dict[str, float]:
    print("\nmodels (issue 41 item 7): model=transformer stacks through the front door, gangserve at world "
          "size 1 (2 threads) and 2 (1 thread per rank) beside the naive peer running the same dense torch "
          "module with 2 threads, interleaved, npy; load average at the start "
          f"{', '.join(f'{v:.1f}' for v in d['load_average_start'])}, at the end "
          f"{', '.join(f'{v:.1f}' for v in d['load_average_end'])}; commit {d.get('commit', '?')}\n")
    print("| request | row | p50 ms | p25-p75 ms | p99 ms | n | Server-Timing medians (ms) | p50 / naive |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    ratios: dict[str, float] = {}
    for label, rows in d["latency"].items():
        naive = rows[M_NAIVE]["p50_ms"]
        for name, r in rows.items():
            timing = ", ".join(f"{k} {v:.1f}" for k, v in r["server_timing"].items()) or "-"
            print(f"| {label} | {name} | {r['p50_ms']:.1f} | {spread(r)} | {r['p99_ms']:.1f} | {r['n']} | {timing} | "
                  f"{r['p50_ms'] / naive:.2f} |")
        # The naive peer runs torch's own nn.TransformerEncoder (its fused fast path included).
        goal = " (goal <= 1.00)" if label.startswith(MODEL_SESSION_STACK) else ""
        ratios[f"ws1 / naive p50, {label}{goal}"] = rows[M_WS1]["p50_ms"] / naive
        ratios[f"ws2 / naive p50, {label}"] = rows[M_WS2]["p50_ms"] / naive
    s = d.get("sessions")
    if s:
        print(f"\nsessions on the {s['stack']} stack, world size {s['world_size']}: one-row appends to a session "
              f"of {s['context']} rows vs POST /infer?causal=true of the {s['context'] + 1}-row sequence "
              f"(each resend followed by appends; open with the {s['context']}-row prefill {s['open_ms']:.0f} ms; "
              f"append output vs the resend's last row: max |diff| {s['max_abs_diff']:.2e})\n")
        print("| row | p50 ms | n |")
        print("|---|---:|---:|")
        print(f"| one-row append at context {s['context']} | {s['append_ms_p50']:.1f} | {s['appends']} |")
        print(f"| resend, /infer?causal=true [1, {s['context'] + 1}, {s['dim']}] | {s['resend_ms_p50']:.1f} | "
              f"{len(s['resend_ms'])} ({', '.join(f'{v:.0f}' for v in s['resend_ms'])}) |")
        ratios[f"resend {s['context'] + 1} rows / one-row append at {s['context']} (goal >= 20)"] = (
            s["resend_ms_p50"] / s["append_ms_p50"])
        g = d.get("sessions_gather")
        if g:  # issue 52: the same append with the attention gathered (the path before)
            a = s.get("attention", {})
            print(f"| one-row append at context {g['context']}, attention gathered (before issue 52) | "
                  f"{g['append_ms_p50']:.1f} | {g['appends']} |")
            print(f"\n(the first row's attention: {a.get('path', '?')}, warmed at bring-up in "
                  f"{a.get('compile_s', 0):.2f} s to build or load and check)")
            ratios["one-row append at 2048: gathered / in place, p50"] = g["append_ms_p50"] / s["append_ms_p50"]
    return {k: round(v, 3) for k, v in ratios.items()}


def print_gangs(rows: dict[str, dict], load_s: float) -> None:
    print(f"\nseveral gangs (num_replicas), world size 2 each: notes' shape p50, small requests at 16 clients for {load_s:.0f}s\n")
    print("| gangs | notes' shape p50 ms | 16 clients req/s | req/s per gang | 16 clients p99 ms | handle calls per gang |")
    print("|---|---:|---:|---:|---:|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['p50_ms']:.1f} | {r['req_per_s']:.0f} | {r['per_gang_req_per_s']:.0f} | "
              f"{r['c16_p99_ms']:.1f} | {r['handle_calls_per_gang']} |")


if __name__ == "__main__":
    main()
