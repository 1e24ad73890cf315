"""Issue 53: the Open Inference Protocol over gRPC against HTTP, through the front door.

One gangserve app (deployments/local.yaml's arguments: world size 2, gloo) behind one Serve
instance with HAProxy on both ports: HTTP (the OIP binary tensor extension, and `/infer` with
an npy body, the fastest HTTP path) and gRPC (`ModelInfer`, `raw_input_contents`, the bytes
`tritonclient.grpc` sends). Every body and message is built once, before the clock: the rows
measure the service's path, not the client's encoding. Rows are interleaved (each round in a
new order) so that noise hits them alike; then each row alone at 16 closed-loop clients on the
small shape, each client with its own connection (an httpx client, a gRPC channel).

    .venv/bin/python bench/run.py --only grpc [--requests N] [--load-seconds S]
"""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
import httpx
import numpy as np

APP = "g_ws2"
INFER = "/inference.GRPCInferenceService/ModelInfer"
SHAPES = {"small [1, 8, 512]": (1, 8, 512), "notes' shape [128, 8, 512]": (128, 8, 512)}
HTTP_OIP, HTTP_NPY, GRPC = "HTTP OIP binary", "HTTP /infer npy", "gRPC ModelInfer"


@dataclass(frozen=True)
class _Reply:
    """What bench.run.interleaved reads of an answer (a gRPC answer has no Server-Timing)."""

    status_code: int = 200
    text: str = ""
    headers: httpx.Headers = field(default_factory=httpx.Headers)


def oip_http_body(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """An OIP binary request (JSON header + raw bytes, binary output) and its headers."""
    header = json.dumps({"inputs": [{"name": "hidden_states", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()
    return header + x.tobytes(), {"content-type": "application/octet-stream",
                                  "inference-header-content-length": str(len(header))}


def grpc_message(x: np.ndarray) -> bytes:
    """A ModelInferRequest as tritonclient.grpc builds it (the same fields; the service's own
    messages, so the bench needs no test extra), serialized."""
    from service.ingress.oip_grpc import gangserve_inference_pb2 as pb

    request = pb.ModelInferRequest(model_name="attention")
    request.inputs.add(name="hidden_states", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


class Calls:
    """One client of each row: a call that sends the prebuilt request and checks the answer."""

    def __init__(self, base: str, grpc_target: str, x: np.ndarray) -> None:
        from bench.run import npy

        self.http = httpx.Client(timeout=120)
        self.channel = grpc.insecure_channel(grpc_target, options=[("grpc.max_send_message_length", -1),
                                                                   ("grpc.max_receive_message_length", -1)])
        self._grpc = self.channel.unary_unary(INFER)
        self._metadata = (("application", APP),)  # HAProxy routes by it when several apps are up
        self._oip, self._oip_headers = oip_http_body(x)
        self._npy = npy(x)
        self._message = grpc_message(x)
        self._base = f"{base}/{APP}"

    def rows(self) -> dict[str, Callable[[], Any]]:
        return {HTTP_OIP: self.http_oip, HTTP_NPY: self.http_npy, GRPC: self.grpc}

    def http_oip(self) -> httpx.Response:
        return self.http.post(self._base + "/v2/models/attention/infer", content=self._oip, headers=self._oip_headers)

    def http_npy(self) -> httpx.Response:
        return self.http.post(self._base + "/infer", content=self._npy, headers={"content-type": "application/x-npy"})

    def grpc(self) -> _Reply:
        reply = self._grpc(self._message, metadata=self._metadata, timeout=120)
        return _Reply(text="") if reply else _Reply(status_code=500, text="an empty gRPC answer")

    def close(self) -> None:
        self.http.close()
        self.channel.close()


def closed_loop(base: str, grpc_target: str, x: np.ndarray, row: str, clients: int, seconds: float) -> dict[str, float]:
    """Answered requests per second (and latency) of `row` with `clients` closed-loop clients."""
    from bench.run import percentiles

    callers = [Calls(base, grpc_target, x) for _ in range(clients)]
    for c in callers:
        reply = c.rows()[row]()  # connect and warm up outside the clock
        assert reply.status_code == 200, reply.text[:300]
    stop = time.monotonic() + seconds
    counts, latencies = [0] * clients, []

    def worker(i: int) -> None:
        call = callers[i].rows()[row]
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            reply = call()
            latencies.append(time.perf_counter() - t0)
            assert reply.status_code == 200, reply.text[:300]
            counts[i] += 1

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, range(clients)))
    for c in callers:
        c.close()
    return {"req_per_s": sum(counts) / seconds, **percentiles(latencies)}


def bench_grpc(base: str, grpc_target: str, n: int, load_s: float) -> dict[str, Any]:
    """The section's rows: interleaved p50/p99 per shape, then 16 clients of each row (small)."""
    from ray import serve

    from bench.run import _commit, interleaved
    from harness.local import local_yaml_args
    from service.app import build_app

    serve.run(build_app(local_yaml_args()), name=APP, route_prefix=f"/{APP}")
    out: dict[str, Any] = {"commit": _commit(), "load_average_start": os.getloadavg(), "latency": {}, "small_c16": {}}
    rng = np.random.default_rng(0)
    for label, shape in SHAPES.items():
        calls = Calls(base, grpc_target, rng.standard_normal(shape, dtype=np.float32))
        out["latency"][label] = interleaved(calls.rows(), n)
        calls.close()
    small = rng.standard_normal(SHAPES["small [1, 8, 512]"], dtype=np.float32)
    for row in (HTTP_OIP, HTTP_NPY, GRPC):
        out["small_c16"][row] = closed_loop(base, grpc_target, small, row, clients=16, seconds=load_s)
    out["load_average_end"] = os.getloadavg()
    serve.delete(APP)
    return out


def print_grpc(d: dict[str, Any], load_s: float) -> dict[str, float]:
    """The section's tables and its goals (gRPC p50 <= HTTP p50 on both shapes; gRPC small-request
    req/s at 16 clients >= HTTP's), against both HTTP rows."""
    print(f"\ngRPC vs HTTP (issue 53), Open Inference Protocol, binary payloads, world size 2, through the front "
          f"door (HAProxy on both ports), interleaved; commit {d.get('commit', '?')}; load average "
          f"{', '.join(f'{v:.1f}' for v in d['load_average_start'])} at the start, "
          f"{', '.join(f'{v:.1f}' for v in d['load_average_end'])} at the end\n")
    print("| shape | " + " | ".join(f"{r} p50 ms" for r in (HTTP_OIP, HTTP_NPY, GRPC)) + " |")
    print("|---|---:|---:|---:|")
    ratios: dict[str, float] = {}
    for label, rows in d["latency"].items():
        print(f"| {label} | " + " | ".join(f"{rows[r]['p50_ms']:.1f}" for r in (HTTP_OIP, HTTP_NPY, GRPC)) + " |")
        for http in (HTTP_OIP, HTTP_NPY):
            ratios[f"{label}: gRPC p50 / {http} p50 (goal <= 1)"] = rows[GRPC]["p50_ms"] / rows[http]["p50_ms"]
    print(f"\nsmall requests [1, 8, 512], 16 clients for {load_s:.0f}s, each with its own connection\n")
    print("| row | req/s | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|")
    for row, r in d["small_c16"].items():
        print(f"| {row} | {r['req_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |")
    for http in (HTTP_OIP, HTTP_NPY):
        ratios[f"small req/s at 16 clients, gRPC / {http} (goal >= 1)"] = (
            d["small_c16"][GRPC]["req_per_s"] / d["small_c16"][http]["req_per_s"])
    from bench.run import print_ratios

    print_ratios("gRPC vs HTTP", ratios)
    return ratios
