"""model=llama against Hugging Face's own LlamaModel, side by side in one run (issue 51, item 7).

A Llama-shaped stack (8 layers, hidden 1024, 16 heads, 4 K/V heads, intermediate 2816, fp32,
random init) saved with `save_pretrained`, then, through the front door (HAProxy, port as
`make serve`), interleaved:

- `/infer` p50 at [1, 128, 1024]: gangserve `model=llama checkpoint=DIR` at world sizes 1 and 2,
  and a naive one-replica Serve peer running `transformers.LlamaModel` from the same directory
  (`inputs_embeds` in, `last_hidden_state` out);
- one-row session appends at context 2048 through HTTP (world size 1), against Hugging Face's
  own incremental decode in this process (`LlamaModel(inputs_embeds=row, past_key_values=cache)`,
  no HTTP), as time per row.

The load generator only sends: every body is built before the first request. Needs the test
extra (transformers): `.venv/bin/python bench/llama.py [--requests N] [--appends N]`.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run import interleaved, npy, percentiles  # noqa: E402

ARCH: dict[str, Any] = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
                        "num_key_value_heads": 4, "intermediate_size": 2816, "rms_norm_eps": 1e-5,
                        "max_position_embeddings": 4096}
CONTEXT = 2048


def save_stack(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    LlamaModel(LlamaConfig(**ARCH, vocab_size=16)).save_pretrained(directory)


def peer_deployment() -> Any:
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment(name="HFLlamaPeer", max_ongoing_requests=64)
    class HFLlamaPeer:
        """What a user would write without us: transformers' LlamaModel in one replica."""

        def __init__(self, directory: str, threads: int) -> None:
            import torch
            from transformers import LlamaModel

            torch.set_num_threads(threads)
            self._torch = torch
            self._model = LlamaModel.from_pretrained(directory).eval()

        async def __call__(self, request: Request) -> Response:
            x = np.load(io.BytesIO(await request.body()), allow_pickle=False)
            with self._torch.inference_mode():
                out = self._model(inputs_embeds=self._torch.from_numpy(x)).last_hidden_state
            buf = io.BytesIO()
            np.save(buf, out.numpy())
            return Response(buf.getvalue(), media_type="application/x-npy")

    return HFLlamaPeer


def hf_decode_per_row(directory: Path, rows: np.ndarray, appends: int) -> dict[str, float]:
    """Hugging Face's own incremental decode in this process: prefill CONTEXT rows, then one-row steps."""
    import torch
    from transformers import DynamicCache, LlamaModel

    torch.set_num_threads(os.cpu_count() or 1)
    model = LlamaModel.from_pretrained(str(directory)).eval()
    samples = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(inputs_embeds=torch.from_numpy(rows[:CONTEXT])[None], past_key_values=cache, use_cache=True)
        for i in range(appends):
            row = torch.from_numpy(rows[CONTEXT + i:CONTEXT + i + 1])[None]
            t0 = time.perf_counter()
            model(inputs_embeds=row, past_key_values=cache, use_cache=True)
            samples.append(time.perf_counter() - t0)
    return percentiles(samples)


def http_append_per_row(base: str, rows: np.ndarray, appends: int) -> dict[str, float]:
    """One session through HTTP: a CONTEXT-row prefill, then one-row appends, each timed."""
    client = httpx.Client(timeout=600)
    bodies = [npy(rows[CONTEXT + i:CONTEXT + i + 1]) for i in range(appends)]
    r = client.post(f"{base}/sessions", content=npy(rows[:CONTEXT]), headers={"content-type": "application/x-npy"})
    assert r.status_code == 201, r.text[:300]
    sid = r.headers["x-session-id"]
    samples = []
    for body in bodies:
        t0 = time.perf_counter()
        r = client.post(f"{base}/sessions/{sid}/append", content=body, headers={"content-type": "application/x-npy"})
        samples.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text[:300]
    client.delete(f"{base}/sessions/{sid}")
    return percentiles(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=15, help="interleaved /infer rounds")
    parser.add_argument("--appends", type=int, default=20, help="one-row appends after the prefill")
    args = parser.parse_args()

    import ray
    from ray import serve

    from harness.local import free_port, front_door_env
    from service.app import build_app

    cores = os.cpu_count() or 1
    directory = Path(tempfile.mkdtemp(prefix="gangserve-llama-bench-")) / "stack"
    save_stack(directory)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 128, ARCH["hidden_size"]), dtype=np.float32)
    rows = rng.standard_normal((CONTEXT + args.appends, ARCH["hidden_size"]), dtype=np.float32)
    results: dict[str, Any] = {"arch": ARCH, "cores": cores}

    # Hugging Face in-process first, alone on the machine (no Serve yet): its best case.
    results["hf_decode_per_row"] = hf_decode_per_row(directory, rows, args.appends)

    os.environ.update(front_door_env())
    os.environ.setdefault("GANGSERVE_STATE_DIR", tempfile.mkdtemp(prefix="gangserve-bench-"))
    ray.init(address="local", num_cpus=max(8, cores), include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    try:
        common = {"model": "llama", "checkpoint": str(directory), "max_seq_len": 4096,
                  "max_tokens_per_request": 1 << 20, "session_cache_bytes": 1 << 30,
                  "max_session_tokens": CONTEXT + args.appends + 16, "warm_spare": False}
        serve.run(build_app({**common, "world_size": 1, "cpus_per_rank": 1.0, "torch_threads_per_rank": cores}),
                  name="llama1", route_prefix="/llama1")
        serve.run(build_app({**common, "world_size": 2, "cpus_per_rank": 1.0,
                             "torch_threads_per_rank": max(1, cores // 2)}), name="llama2", route_prefix="/llama2")
        serve.run(peer_deployment().options(ray_actor_options={"num_cpus": 1}).bind(str(directory), cores),
                  name="hfpeer", route_prefix="/hfpeer")
        client = httpx.Client(timeout=600)
        body = npy(x)

        def poster(url: str) -> Callable[[], httpx.Response]:
            return lambda: client.post(url, content=body, headers={"content-type": "application/x-npy"})

        results["infer"] = interleaved({"gangserve llama ws1": poster(f"{base}/llama1/infer"),
                                        "gangserve llama ws2": poster(f"{base}/llama2/infer"),
                                        "naive peer: transformers LlamaModel": poster(f"{base}/hfpeer")},
                                       args.requests, warmup=2)
        serve.delete("llama2")
        serve.delete("hfpeer")
        results["http_append_per_row_ws1"] = http_append_per_row(f"{base}/llama1", rows, args.appends)
        results["gang"] = client.get(f"{base}/llama1/gang").json().get("param_bytes_per_rank")
    finally:
        serve.shutdown()
        ray.shutdown()

    infer = results["infer"]
    peer = infer["naive peer: transformers LlamaModel"]["p50_ms"]
    print("\n| row | p50 ms | / peer |\n|---|---:|---:|")
    for name, row in infer.items():
        print(f"| /infer [1, 128, 1024] {name} | {row['p50_ms']:.1f} | {row['p50_ms'] / peer:.2f} |")
    hf, ours = results["hf_decode_per_row"]["p50_ms"], results["http_append_per_row_ws1"]["p50_ms"]
    print(f"| one-row append at context {CONTEXT}, HTTP, ws1 | {ours:.1f} | {ours / hf:.2f} (/ HF in-process) |")
    print(f"| one-row step at context {CONTEXT}, HF LlamaModel + DynamicCache, in process | {hf:.1f} | 1.00 |")
    print(json.dumps(results, default=str, indent=1)[:4000])


if __name__ == "__main__":
    main()
