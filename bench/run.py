"""gangserve benchmark: everything side by side in ONE run, printed as a markdown table.

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
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.reference import dense_reference, notes_seed_weights  # noqa: E402

SHAPE = (128, 8, 512)  # the original notes' request


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    return {
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))],
        "n": len(ms),
    }


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


def bench_gangserve(x: np.ndarray, n: int) -> dict[str, dict[str, float]]:
    import ray
    from ray import serve
    from safetensors.numpy import save as st_save

    from service.app import build_app
    from tests.conftest import free_port, local_yaml_args

    ray.init(include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(local_yaml_args()), name="gangserve", route_prefix="/")
        url = f"http://127.0.0.1:{port}/infer"
        client = httpx.Client(timeout=120)
        body_st = st_save({"hidden_states": x})
        npy = io.BytesIO()
        np.save(npy, x)
        body_json = json.dumps({"hidden_states": x.tolist()}).encode()

        def post(body: bytes, media: str) -> Callable[[], None]:
            def call() -> None:
                r = client.post(url, content=body, headers={"content-type": media})
                assert r.status_code == 200, r.text

            return call

        return {
            "gangserve ws2 safetensors": time_calls(post(body_st, "application/x-safetensors"), n),
            "gangserve ws2 npy": time_calls(post(npy.getvalue(), "application/x-npy"), n),
            "gangserve ws2 json": time_calls(post(body_json, "application/json"), max(5, n // 4)),
        }
    finally:
        serve.shutdown()
        ray.shutdown()


def bench_codecs(x: np.ndarray, n: int = 50) -> dict[str, dict[str, float]]:
    """Encode + decode of one tensor per wire codec (service.codecs), printed side by side.

    "decode" is what the ingress does to a request body, "encode" what it does to a reply;
    JSON is timed with fewer repetitions (it is ~1000x slower).
    """
    from service import codecs

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=30, help="timed requests per row")
    args = parser.parse_args()
    torch.manual_seed(42)
    x = torch.randn(*SHAPE)
    rows: dict[str, dict[str, float]] = {}
    codec_rows = bench_codecs(x.numpy())
    rows["in-process dense nn.MultiheadAttention"] = bench_in_process(x, args.requests)
    rows.update(bench_gangserve(x.numpy(), args.requests))
    floor = rows["in-process dense nn.MultiheadAttention"]["p50_ms"]
    print(f"\nshape {list(SHAPE)} float32, {os.cpu_count()} cores, {platform.processor() or platform.machine()}\n")
    print("| path | p50 ms | p99 ms | p50 / in-process |")
    print("|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['p50_ms'] / floor:.2f} |")
    out = ROOT / "bench" / "results" / "latest.json"
    out.write_text(json.dumps({"shape": SHAPE, "rows": rows, "codecs": codec_rows, "time": time.time()}, indent=2))
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
