"""GPU check, tier C: the service as users get it, through Serve at world size 1 on the GPU
(needs Ray, Serve, FastAPI and the rest: bench/gpu/wheelhouse.sh carries them; gpu_check.sh
runs this tier only when `import service.app` works).

As users get it: the front door's environment (RAY_SERVE_ENABLE_HA_PROXY and
RAY_SERVE_ENABLE_DIRECT_INGRESS, service.cluster.front_door) is set before Ray starts, so
port 8000 is HAProxy straight to the Ingress replicas, not Serve's Python proxy.

One Serve instance holds gangserve (use_gpu, backend nccl, world size 1), the echo floor
(bench.peers.EchoPeer) and a dense GPU peer (nn.MultiheadAttention on the GPU in one
replica, what a user would write without us). The dense peer is a `num_gpus: 0` actor next
to the gang's rank, which holds the one GPU: it sees the GPU only while Ray leaves
CUDA_VISIBLE_DEVICES alone for such actors (RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO off, set so
here, since Ray means to change that default), and a row prints the device it computes on.
Rows: the front door, /gang's backend and device, gangserve vs the dense reference, p50 of
each at the notes' shape (npy), the medians of gangserve's Server-Timing phases (its `gang`
phase is the step), then the models issue's 12-layer stack (model=transformer) in place of
the attention app: its parity with torch's dense TransformerEncoder and its p50.

GPU_CHECK_DRY_RUN=1: the same on the CPU (gloo, no GPU asked for), on a free port.
"""
from __future__ import annotations

import io
import os
import sys
import time
from typing import Any

from common import row, section, wall_ms  # noqa: E402  (sets sys.path)

import numpy as np
import torch

DRY_RUN = os.environ.get("GPU_CHECK_DRY_RUN") == "1"
DEV = torch.device("cpu" if DRY_RUN else "cuda")
E, H = 512, 8
# The models issue's stack, as builder arguments (tier A checks the same one without Ray).
STACK = {"model": "transformer", "num_layers": 12, "embed_dim": E, "num_heads": H, "ffn_dim": 4 * E,
         "init": "random", "seed": 7}
DEPLOY_S = 90.0  # one app's deploy, ready included (the gang's bring-up: a CUDA context, the weights)


def deploy(app: Any, name: str, prefix: str, base: str, timeout_s: float = DEPLOY_S, ready: bool = True) -> float:
    """Deploy `app` and wait, bounded, until Serve says RUNNING (and, with `ready`, its /readyz
    answers 200); returns the seconds it took. A failed deploy raises at once with Serve's
    message; past timeout_s, TimeoutError with the last status and /readyz answer."""
    import httpx
    from ray import serve

    started = time.monotonic()
    serve._run(app, name=name, route_prefix=prefix, _blocking=False)
    last = ""
    while time.monotonic() - started < timeout_s:
        status = serve.status().applications.get(name)
        state = str(getattr(status, "status", "absent"))
        if state.endswith("DEPLOY_FAILED"):
            raise RuntimeError(f"app {name}: DEPLOY_FAILED: {str(getattr(status, 'message', ''))[:300]}")
        last = state
        if state.endswith("RUNNING"):
            if not ready:
                return time.monotonic() - started
            try:
                reply = httpx.get(f"{base}{prefix.rstrip('/')}/readyz", timeout=5)
                if reply.status_code == 200:
                    return time.monotonic() - started
                last = f"{state}, /readyz {reply.status_code} {reply.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{state}, /readyz {type(exc).__name__}"
        time.sleep(0.5)
    raise TimeoutError(f"app {name} not ready after {timeout_s:.0f}s (last: {last})")


def main() -> int:
    if not DRY_RUN and not torch.cuda.is_available():
        row("tier C", "no CUDA: tier skipped")
        return 0
    import httpx
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    from bench.peers import EchoPeer
    from harness.local import free_port, front_door_env
    from harness.reference import dense_reference, relative_error
    from service.app import build_app
    from service.parallel.weights import seed_weights

    if DRY_RUN:
        row("tier C", "DRY RUN on the CPU with gloo: checks the script only")

    @serve.deployment(name="DenseGPUPeer", ray_actor_options={"num_cpus": 1, "num_gpus": 0})
    class DenseGPUPeer:
        def __init__(self, device: str) -> None:
            self._dev = torch.device(device)
            # What this actor sees: with no GPU visible the row says so instead of a CUDA error.
            self._seen = {"device": device, "cuda_available": torch.cuda.is_available(),
                          "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"),
                          "name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-"}
            self._mha = dense_reference(seed_weights(E), H).to(self._dev) \
                if self._dev.type == "cpu" or torch.cuda.is_available() else None

        async def __call__(self, request: Request) -> Response:
            if request.method == "GET":
                return JSONResponse(self._seen)
            if self._mha is None:
                return Response(f"no GPU visible: {self._seen}", status_code=503)
            x = torch.from_numpy(np.load(io.BytesIO(await request.body()), allow_pickle=False)).to(self._dev)
            with torch.inference_mode():
                out = self._mha(x, x, x, need_weights=False)[0].cpu().numpy()
            buf = io.BytesIO()
            np.save(buf, out)
            return Response(buf.getvalue(), media_type="application/x-npy")

    x = np.random.default_rng(42).standard_normal((128, 8, E)).astype(np.float32)
    body = io.BytesIO()
    np.save(body, x)
    payload = body.getvalue()
    mha = dense_reference(seed_weights(E), H).to(DEV)
    xc = torch.from_numpy(x).to(DEV)

    def dense_attention() -> None:
        with torch.inference_mode():
            mha(xc, xc, xc, need_weights=False)
        if DEV.type == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        want = mha(xc, xc, xc, need_weights=False)[0].cpu()
    row(f"in-process dense MHA on {DEV.type} 128x8x512, p50 ms", f"{wall_ms(dense_attention, n=30):.3f}")

    # Before Ray starts: its controller, HAProxy and replicas read these when they start.
    door = front_door_env()
    os.environ.update(door)
    os.environ["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "0"
    port = int(os.environ.get("GPU_CHECK_PORT") or (free_port() if DRY_RUN else 8000))
    row("front door (set before Ray starts)",
        ", ".join(f"{k}={v}" for k, v in door.items() if k.startswith("RAY_SERVE_ENABLE")) + f"; port {port}")
    import ray

    ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), num_gpus=0 if DRY_RUN else 1,
             include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    client = httpx.Client(timeout=60)
    base = f"http://127.0.0.1:{port}"
    gang_args = {"world_size": 1, "use_gpu": not DRY_RUN, "backend": "gloo" if DRY_RUN else "nccl",
                 "cpus_per_rank": 2, "warm_spare": False}
    headers = {"content-type": "application/x-npy"}

    def post(path: str, data: bytes = payload) -> httpx.Response:
        r = client.post(f"{base}{path}", content=data, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {r.text[:200]}")
        return r

    try:
        with section("deploy"):
            took = deploy(build_app(gang_args), "gangserve", "/", base)
            took += deploy(EchoPeer.bind(), "echo", "/echo", base, ready=False)
            took += deploy(DenseGPUPeer.bind(str(DEV)), "dense", "/dense", base, ready=False)
            row("three apps deployed, s", f"{took:.1f}")
        with section("gang"):
            gang = client.get(f"{base}/gang").json()
            rank0 = (gang.get("ranks") or [{}])[0]
            row("/gang backend, state, rank 0 device", f"{gang.get('backend')}, {gang.get('state')}, {rank0.get('device')}")
            row("/gang memory per CUDA rank", gang.get("memory") or "(none: no CUDA rank)")
        with section("dense peer device"):
            seen = client.get(f"{base}/dense").json()
            row("dense peer device (a num_gpus=0 actor)", ", ".join(f"{k} {v}" for k, v in seen.items()))
            if not DRY_RUN and not seen.get("cuda_available"):
                row("dense peer", "FAILED: it sees no GPU, its p50 below would not be a GPU's")
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
        with section("12-layer stack"):
            _stack_rows(client, base, gang_args, post)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _stack_rows(client: Any, base: str, gang_args: dict[str, Any], post: Any) -> None:
    """The models issue's stack in place of the attention app (one GPU holds one gang)."""
    from ray import serve

    from harness.reference import relative_error
    from service.app import build_app
    from service.config.builder_args import AppConfig
    from service.parallel.registry import resolve

    cfg = AppConfig.model_validate({**gang_args, **STACK})
    serve.delete("gangserve")
    took = deploy(build_app({**gang_args, **STACK}), "gangserve", "/", base)
    row(f"12-layer stack ({STACK['num_layers']} layers, E {E}, ffn {STACK['ffn_dim']}) deployed, s", f"{took:.1f}")
    arch = resolve(cfg.model)
    dense = arch.dense_module().double().eval()
    dense.load_state_dict({k: v.double() for k, v in arch.init_weights("random", 7).items()}, strict=True)
    x = np.random.default_rng(5).standard_normal((4, 24, E)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, x)
    with torch.inference_mode():
        want = arch.dense_forward(dense, torch.from_numpy(x).double())
    got = torch.from_numpy(np.load(io.BytesIO(post("/infer", buf.getvalue()).content)))
    row("12-layer stack vs dense float64 relative error (4x24)", f"{relative_error(got, want):.2e}")
    n = 3 if DRY_RUN else 20  # a CPU takes most of a second per step of the stack at this shape
    row("12-layer stack /infer npy 128x8x512, p50 ms", f"{wall_ms(lambda: post('/infer'), n=n, warmup=1):.2f}")


if __name__ == "__main__":
    sys.exit(main())
