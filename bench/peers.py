"""What a user would deploy instead of gangserve, for side-by-side comparison.

- EchoPeer: returns the request body unchanged: the Serve HTTP transport floor.
- NaivePeer: one replica running dense nn.MultiheadAttention on npy bodies: what you
  would write without us (plain `__call__(request)`, no batching, no sharding).
"""
from __future__ import annotations

import io
import time

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import Response


@serve.deployment(name="EchoPeer", ray_actor_options={"num_cpus": 0})
class EchoPeer:
    async def __call__(self, request: Request) -> Response:
        return Response(await request.body(), media_type=request.headers.get("content-type"))


@serve.deployment(name="NaivePeer", max_ongoing_requests=64)
class NaivePeer:
    def __init__(self, threads: int) -> None:
        import torch

        from service.parallel.weights import seed_weights
        from harness.reference import dense_reference

        torch.set_num_threads(threads)
        self._torch = torch
        self._mha = dense_reference(seed_weights(512), 8)

    async def __call__(self, request: Request) -> Response:
        t0 = time.perf_counter()
        body = await request.body()
        t1 = time.perf_counter()
        x = np.load(io.BytesIO(body), allow_pickle=False)
        t2 = time.perf_counter()
        with self._torch.inference_mode():
            xt = self._torch.from_numpy(x)
            out, _ = self._mha(xt, xt, xt, need_weights=False)
        t3 = time.perf_counter()
        buf = io.BytesIO()
        np.save(buf, out.numpy())
        t4 = time.perf_counter()
        # The same phases as gangserve's Server-Timing (its "gang" is our "compute").
        timing = ", ".join(f"{name};dur={(b - a) * 1000:.2f}" for name, a, b in
                           (("read", t0, t1), ("decode", t1, t2), ("compute", t2, t3), ("encode", t3, t4)))
        return Response(buf.getvalue(), media_type="application/x-npy", headers={"Server-Timing": timing})
