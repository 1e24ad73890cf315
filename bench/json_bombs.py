"""A small valid request's latency while JSON bombs are in flight (issue 12, item 2).

Starts a local Ray + Serve with the `make serve` app (deployments/local.yaml arguments),
then times sequential small `POST /infer` requests (npy [1, 8, 512]):

- quiet: nothing else in flight;
- next to `--streams` clients that each keep posting a JSON bomb of about
  `--bomb-mib` MiB (default: just under max_json_bytes): long flat lists of zeros,
  millions of empty lists, one-element rows, strings;
- next to the same number of clients posting valid JSON tensors of about the same size
  (these are decoded and computed; the small requests share the CPU with them).

    .venv/bin/python bench/json_bombs.py [--requests 200] [--streams 4]

Prints a markdown table (p50 / p99 / max in ms over every small request, the small
requests that did not get 200, and the background bodies' answers by status).
Compare ratios, not absolute numbers: the machine is noisy.
"""
from __future__ import annotations

import argparse
import collections
import io
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BOMB_KINDS = {"zeros": b"0,", "empty lists": b"[],", "one-element rows": b"[0],", "strings": b'"a",'}


def bomb(unit: bytes, size: int) -> bytes:
    return b'{"hidden_states": [' + (unit * (size // len(unit))).rstrip(b",") + b"]}"


def valid_json(size: int) -> bytes:
    """A valid [1, seq, 512] JSON request of about `size` bytes (3-decimal values)."""
    seq = max(1, size // (512 * 8))
    x = np.round(np.random.default_rng(0).standard_normal((1, seq, 512)), 3)
    body = json.dumps({"hidden_states": x.tolist()}).encode()
    while len(body) > size and seq > 1:
        seq = int(seq * 0.9)
        body = json.dumps({"hidden_states": x[:, :seq].tolist()}).encode()
    return body


def percentiles(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {"p50": ms[len(ms) // 2], "p99": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))], "max": ms[-1]}


def measure(base: str, small: bytes, n: int, background: list[bytes]) -> dict[str, object]:
    stop = threading.Event()
    statuses: collections.Counter[int] = collections.Counter()

    def hammer(body: bytes) -> None:
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                r = client.post(base + "/infer", content=body, headers={"content-type": "application/json"})
                statuses[r.status_code] += 1

    latencies = []
    failures: collections.Counter[int] = collections.Counter()
    with ThreadPoolExecutor(max(1, len(background))) as pool:
        futures = [pool.submit(hammer, body) for body in background]
        try:
            time.sleep(1.0 if background else 0)
            with httpx.Client(timeout=120) as client:
                for i in range(n + 5):
                    t0 = time.perf_counter()
                    r = client.post(base + "/infer", content=small, headers={"content-type": "application/x-npy"})
                    if i >= 5:  # warm-up
                        latencies.append(time.perf_counter() - t0)
                        if r.status_code != 200:
                            failures[r.status_code] += 1
                    elif r.status_code != 200:
                        raise AssertionError(f"warm-up failed: {r.text[:300]}")
        finally:
            stop.set()
        for future in futures:
            future.result()
    return {**percentiles(latencies), "failed": dict(sorted(failures.items())),
            "background": dict(sorted(statuses.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--bomb-mib", type=float, default=7.9)
    args = parser.parse_args()

    import ray
    from ray import serve

    from service.app import build_app
    from harness.local import free_port, local_yaml_args

    os.environ.setdefault("GANGSERVE_API_TOKEN", "bench-token")
    os.environ.setdefault("GANGSERVE_STATE_DIR", tempfile.mkdtemp(prefix="gangserve-bench-"))
    # address="local": a fresh cluster of our own, never one some other process on this machine started.
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    try:
        serve.run(build_app(local_yaml_args()), name="gangserve", route_prefix="/")
        buf = io.BytesIO()
        np.save(buf, np.random.default_rng(1).standard_normal((1, 8, 512)).astype(np.float32))
        small = buf.getvalue()
        size = int(args.bomb_mib * 1024 * 1024)
        kinds = list(BOMB_KINDS.values())
        bombs = [bomb(kinds[i % len(kinds)], size) for i in range(args.streams)]
        rows = {
            "quiet": measure(base, small, args.requests, []),
            f"{args.streams} JSON bomb streams (~{args.bomb_mib:g} MiB each)": measure(base, small, args.requests, bombs),
            f"{args.streams} valid JSON streams (~{args.bomb_mib:g} MiB each)":
                measure(base, small, args.requests, [valid_json(size)] * args.streams),
        }
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"\nsmall valid request (npy [1, 8, 512], sequential, n={args.requests}) while other bodies are in flight\n")
    print("| in flight | p50 ms | p99 ms | max ms | small requests failed (status: count) | background answers (status: count) |")
    print("|---|---:|---:|---:|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['p50']:.1f} | {row['p99']:.1f} | {row['max']:.1f} | {row['failed'] or 'none'} "
              f"| {row['background'] or '-'} |")


if __name__ == "__main__":
    main()
