"""The GPU half of bench/gpu_check.sh (see there). Single GPU, world_size 1.

1. NCCL smoke test: a 1-rank NCCL process group, one all_reduce on cuda:0.
2. gangserve through Serve with use_gpu=true, backend=auto at world_size 1: /gang must
   report device cuda:0; outputs checked against dense nn.MultiheadAttention on the GPU.
3. Timings: in-process dense MHA on cuda vs gangserve /infer (npy) on the notes' shape.
"""
from __future__ import annotations

import io
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def nccl_smoke() -> str:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=30))
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return f"ok (nccl {'.'.join(map(str, torch.cuda.nccl.version()))})"


def p50_ms(fn, n: int = 30) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return float(np.median(samples))


def main() -> int:
    import httpx
    import ray
    from ray import serve

    from service.app import build_app
    from service.parallel.weights import seed_weights
    from harness.reference import dense_reference, relative_error

    rows: list[tuple[str, str]] = [("GPU", torch.cuda.get_device_name(0)), ("NCCL 1-rank all_reduce", nccl_smoke())]
    torch.manual_seed(42)
    x = torch.randn(128, 8, 512)
    mha = dense_reference(seed_weights(512), 8).cuda()
    xc = x.cuda()

    def dense() -> None:
        with torch.inference_mode():
            mha(xc, xc, xc, need_weights=False)
        torch.cuda.synchronize()

    rows.append(("in-process dense MHA on cuda, p50 ms", f"{p50_ms(dense):.2f}"))
    with torch.inference_mode():
        want = mha(xc, xc, xc, need_weights=False)[0].cpu()

    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=False)
    port = 8000
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        args = {"world_size": 1, "use_gpu": True, "backend": "auto", "cpus_per_rank": max(1, (os.cpu_count() or 2) // 2)}
        serve.run(build_app(args), name="gangserve", route_prefix="/")
        client = httpx.Client(timeout=120)
        gang = client.get(f"http://127.0.0.1:{port}/gang").json()
        rows.append(("/gang backend, device", f"{gang['backend']}, {gang['ranks'][0]['device']}"))
        buf = io.BytesIO()
        np.save(buf, x.numpy())
        body = buf.getvalue()

        def post() -> bytes:
            r = client.post(f"http://127.0.0.1:{port}/infer", content=body, headers={"content-type": "application/x-npy"})
            assert r.status_code == 200, r.text
            return r.content

        out = torch.from_numpy(np.load(io.BytesIO(post())))
        rows.append(("gangserve vs dense relative error", f"{relative_error(out, want):.2e}"))
        rows.append(("gangserve ws1 /infer npy, p50 ms", f"{p50_ms(post):.2f}"))
        ok = gang["ranks"][0]["device"].startswith("cuda") and relative_error(out, want) < 1e-4
    finally:
        serve.shutdown()
        ray.shutdown()
    print("\n| check | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
