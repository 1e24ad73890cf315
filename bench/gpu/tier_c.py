"""GPU check, tier C: the service through Serve at world size 1 on the GPU (needs Ray, Serve,
FastAPI and the rest: bench/gpu/wheelhouse.sh carries them; gpu_check.sh runs this tier only
when `import service.app` works).

One Serve instance holds gangserve (use_gpu, backend nccl, world size 1), the echo floor
(bench.peers.EchoPeer) and a dense GPU peer (nn.MultiheadAttention on the GPU in one
replica, what a user would write without us). Rows: /gang's backend and device, gangserve
vs the dense reference, p50 of each at the notes' shape (npy), and the medians of
gangserve's Server-Timing phases (its `gang` phase is the step).
"""
from __future__ import annotations

import io
import os
import sys
import time

from common import row, section, wall_ms  # noqa: E402  (sets sys.path)

import numpy as np
import torch


def main() -> int:
    if not torch.cuda.is_available():
        row("tier C", "no CUDA: tier skipped")
        return 0
    import httpx
    import ray
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    from bench.peers import EchoPeer
    from harness.reference import dense_reference, relative_error
    from service.app import build_app
    from service.parallel.weights import seed_weights

    @serve.deployment(name="DenseGPUPeer", ray_actor_options={"num_cpus": 1, "num_gpus": 0})
    class DenseGPUPeer:  # num_gpus=0 still sees the GPU in Ray 2.60 (CUDA_VISIBLE_DEVICES untouched)
        def __init__(self) -> None:
            self._mha = dense_reference(seed_weights(512), 8).cuda()

        async def __call__(self, request: Request) -> Response:
            x = torch.from_numpy(np.load(io.BytesIO(await request.body()), allow_pickle=False)).cuda()
            with torch.inference_mode():
                out = self._mha(x, x, x, need_weights=False)[0].cpu().numpy()
            buf = io.BytesIO()
            np.save(buf, out)
            return Response(buf.getvalue(), media_type="application/x-npy")

    x = np.random.default_rng(42).standard_normal((128, 8, 512)).astype(np.float32)
    body = io.BytesIO()
    np.save(body, x)
    payload = body.getvalue()
    mha = dense_reference(seed_weights(512), 8).cuda()
    xc = torch.from_numpy(x).cuda()

    def dense_attention() -> None:
        with torch.inference_mode():
            mha(xc, xc, xc, need_weights=False)
        torch.cuda.synchronize()

    with torch.inference_mode():
        want = mha(xc, xc, xc, need_weights=False)[0].cpu()
    row("in-process dense MHA on cuda 128x8x512, p50 ms", f"{wall_ms(dense_attention, n=30):.3f}")

    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    client = httpx.Client(timeout=60)
    base = "http://127.0.0.1:8000"
    try:
        with section("deploy"):
            started = time.monotonic()
            serve.run(build_app({"world_size": 1, "use_gpu": True, "backend": "nccl", "cpus_per_rank": 2}),
                      name="gangserve", route_prefix="/")
            serve.run(EchoPeer.bind(), name="echo", route_prefix="/echo")
            serve.run(DenseGPUPeer.bind(), name="dense", route_prefix="/dense")
            row("three apps deployed, s", f"{time.monotonic() - started:.1f}")
        gang = client.get(f"{base}/gang").json()
        row("/gang backend, state, rank 0 device", f"{gang.get('backend')}, {gang.get('state')}, "
                                                   f"{(gang.get('ranks') or [{}])[0].get('device')}")
        headers = {"content-type": "application/x-npy"}

        def post(path: str) -> httpx.Response:
            r = client.post(f"{base}{path}", content=payload, headers=headers)
            if r.status_code != 200:
                raise RuntimeError(f"{path}: {r.status_code} {r.text[:200]}")
            return r

        with section("gangserve parity"):
            out = torch.from_numpy(np.load(io.BytesIO(post("/infer").content)))
            row("gangserve vs dense relative error", f"{relative_error(out, want):.2e}")
        for path in ("/infer", "/dense", "/echo"):
            with section(f"p50 {path}"):
                row(f"{path} npy 128x8x512, p50 ms", f"{wall_ms(lambda: post(path), n=30):.2f}")
        with section("server timing"):
            phases: dict[str, list[float]] = {}
            for _ in range(20):
                for part in post("/infer").headers.get("server-timing", "").split(","):
                    if ";dur=" in part:
                        name, dur = part.strip().split(";dur=")
                        phases.setdefault(name, []).append(float(dur))
            row("gangserve Server-Timing medians ms",
                ", ".join(f"{k} {sorted(v)[len(v) // 2]:.2f}" for k, v in phases.items()))
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
