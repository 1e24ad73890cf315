"""What a user would deploy instead of gangserve, for side-by-side comparison.

- EchoPeer: returns the request body unchanged: the Serve HTTP transport floor.
- NaivePeer: one replica running a dense torch module on npy bodies: what you would write
  without us (plain `__call__(request)`, no batching, no sharding). By default the notes'
  attention layer as torch's nn.MultiheadAttention (the rows measured since issue 16); with
  `model` (builder arguments of service.config.builder_args.ModelConfig: `model`, its architecture, `init`,
  `seed`) the model's own `dense_module()` with `init_weights(init, seed)` (the weights the
  gang of those arguments holds), run through its `dense_forward` (`?causal=true` honoured).
"""
from __future__ import annotations

import io
import time
from typing import Any

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
    def __init__(self, threads: int, model: dict[str, Any] | None = None) -> None:
        import torch

        torch.set_num_threads(threads)
        self._torch = torch
        if model is None:
            from service.parallel.weights import seed_weights
            from harness.reference import dense_reference

            mha = dense_reference(seed_weights(512), 8)
            self._forward = lambda x, causal: mha(x, x, x, need_weights=False)[0]
            return
        from service.config.builder_args import ModelConfig
        from service.parallel.registry import resolve

        cfg = ModelConfig(**model)
        arch = resolve(cfg)
        module = arch.dense_module()
        module.load_state_dict(arch.init_weights(cfg.init, cfg.seed), strict=True)
        module.eval()
        self._forward = lambda x, causal: arch.dense_forward(module, x, None, causal)

    async def __call__(self, request: Request) -> Response:
        t0 = time.perf_counter()
        body = await request.body()
        t1 = time.perf_counter()
        x = np.load(io.BytesIO(body), allow_pickle=False)
        causal = request.query_params.get("causal", "false").lower() == "true"
        t2 = time.perf_counter()
        with self._torch.inference_mode():
            out = self._forward(self._torch.from_numpy(x), causal)
        t3 = time.perf_counter()
        buf = io.BytesIO()
        np.save(buf, out.numpy())
        t4 = time.perf_counter()
        # The same phases as gangserve's Server-Timing (its "gang" is our "compute").
        timing = ", ".join(f"{name};dur={(b - a) * 1000:.2f}" for name, a, b in
                           (("read", t0, t1), ("decode", t1, t2), ("compute", t2, t3), ("encode", t3, t4)))
        return Response(buf.getvalue(), media_type="application/x-npy", headers={"Server-Timing": timing})
