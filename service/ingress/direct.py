"""The direct data plane: the gang server replica (rank 0's process) serves inference over
HTTP itself (builder arg `direct_data_plane`, default off).

Why: a request through the ingress crosses one more Python process than it must (HTTP
proxy -> ingress replica -> data channel or handle -> rank 0). Here the client's
connection ends in the process that owns rank 0: the body is read, decoded and validated
there and handed to the same in-process path the data channel server calls
(`GangServer.infer`), so no socket, no handle call and no copy between processes remain.

What it serves: `POST /infer` and OIP v2 `POST /v2/models/attention[/versions/1]/infer`,
with the ingress's own route code (service.ingress.routes.infer / .oip: codecs, body and
shape limits, Content-Type negotiation, `X-Request-Timeout-Seconds`, masks,
Server-Timing), its token check (`AuthMiddleware`, before any body is read), its error
mapping (`install_error_handlers`: `{"error", "code"}`) and its request metrics (counted in
the gang server's process, reported with the gang). Nothing else: status, readiness,
training, weights and the UI stay on the ingress, the front door that answers 503 with
needed-vs-free while no gang is placed (a direct server exists only once its gang was
placed and started).

Errors differ from the ingress in one way, on purpose: a request that reaches a broken or
rebuilding gang is answered 503 at once (`gang_broken`, `gang_rebuilding`, with
Retry-After) instead of waiting for the rebuild; the ingress waits and retries in service
(service.ingress.gang_client), and with several gangs it reaches another one. The client's
direct mode sends such a request to the ingress (gangserve_client.client).

Lifetime: started by the replica after its gang is up, as a task on the replica's event
loop (uvicorn on a socket bound here, so the port is known before the first request and
a fixed port that is taken fails at once, logged, without failing the replica); closed
at drain (`GangServer.__del__`): the listening socket closes first (new connections are
refused: clients fall back to the ingress), accepted requests finish.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any, Awaitable, Callable, Iterator

import numpy as np
import uvicorn
from fastapi import APIRouter, FastAPI

from service.config import AppConfig
from service.deadlines import seconds_left
from service.ingress.api import install_error_handlers
from service.ingress.auth import AuthMiddleware, load_api_token, load_infer_token
from service.ingress.deps import DecodePool
from service.ingress.observe import RequestMetrics
from service.ingress.oip import routes as oip
from service.ingress.routes import infer
from service.tunables import TUNABLES

log = logging.getLogger("gangserve.direct")

START_TIMEOUT_S = TUNABLES.transport.direct_start_timeout_s
LISTEN_BACKLOG = TUNABLES.transport.direct_listen_backlog
# Accepted requests finish within the gang server's own drain bound.
DRAIN_TIMEOUT_S = TUNABLES.gang.drain_timeout_s

# rank 0's in-process path: (x [b, s, E] float32, key mask [b, s] bool | None, causal | None,
# timeout_s= the seconds left until the deadline | None) -> [b, s, E] float32
InferFn = Callable[..., Awaitable[np.ndarray]]


class LocalGang:
    """What the inference routes need of a gang (`infer(x, mask, causal, deadline)`, as
    service.ingress.gang_client.GangClient has), served by the gang in this process: the
    deadline travels as the seconds left, exactly as over the data channel."""

    def __init__(self, infer_fn: InferFn) -> None:
        self._infer = infer_fn
        self.requests = 0

    async def infer(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    deadline: float | None = None) -> np.ndarray:
        self.requests += 1
        return await self._infer(x, mask, causal, timeout_s=seconds_left(deadline))


def create_direct_api(config: AppConfig, gang: LocalGang) -> FastAPI:
    """The data plane's ASGI app: the ingress's inference routes, auth, metrics and errors."""
    app = FastAPI(title="gangserve direct data plane", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config
    app.state.gang = gang
    app.state.api_token, _ = load_api_token()
    app.state.infer_token = load_infer_token()
    app.state.decode_pool = DecodePool(config.decode_threads, config.max_pending_decodes)
    app.add_middleware(AuthMiddleware, api_token=app.state.api_token, infer_token=app.state.infer_token)
    app.add_middleware(RequestMetrics)  # into this process's metrics, reported with the gang's
    app.include_router(infer.router)
    # OIP: only its infer routes (metadata and readiness are the ingress's: they need the fleet view).
    oip_infer = APIRouter()
    oip_infer.routes.extend(r for r in oip.router.routes if getattr(r, "path", "").endswith("/infer"))
    app.include_router(oip_infer)
    install_error_handlers(app)
    return app


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the replica's process belongs to Ray, whose
    SIGTERM handling must stay as it is (uvicorn installs its own on the main thread)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class DirectDataPlane:
    """The HTTP server of one gang server replica; every wait bounded."""

    def __init__(self, config: AppConfig, infer_fn: InferFn) -> None:
        self._cfg = config
        self.gang = LocalGang(infer_fn)
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.url: str | None = None
        self.error: str | None = None  # why it does not listen, when it could not start

    async def start(self, host: str, port: int) -> str | None:
        """Listen on host:port (0: a port the OS chooses); the URL, or None when the port
        cannot be bound or the server does not start (logged; the replica serves on
        without it, through the ingress)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on an accepted connection only when
        # its socket says proto == IPPROTO_TCP, and accepted sockets inherit the listener's 0
        # otherwise: every reply then waited out the client's delayed ACK (measured: 44 ms
        # per request instead of 0.8 ms for a small echo).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            self.error = f"cannot listen on {host}:{port}: {exc.strerror or exc}"
            log.warning("direct data plane off: %s; requests go through the ingress", self.error)
            return None
        bound = sock.getsockname()[1]
        config = uvicorn.Config(
            create_direct_api(self._cfg, self.gang), lifespan="off", log_level="warning", access_log=False,
            server_header=False,
            timeout_graceful_shutdown=max(1, round(DRAIN_TIMEOUT_S)),
        )
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        loop = asyncio.get_running_loop()
        until = loop.time() + START_TIMEOUT_S
        while not self._server.started and not self._task.done() and loop.time() < until:
            await asyncio.sleep(0.01)
        if not self._server.started:
            why = self._task.exception() if self._task.done() and not self._task.cancelled() else \
                f"not started within {START_TIMEOUT_S:g}s"
            self.error = f"the HTTP server on {host}:{bound} did not start: {why}"
            log.warning("direct data plane off: %s", self.error)
            self.close()
            sock.close()
            return None
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        self.url = f"http://{shown}:{bound}"
        log.info("direct data plane at %s (POST /infer, /v2/models/attention/infer)", self.url)
        return self.url

    def stats(self) -> dict[str, Any]:
        return {"url": self.url, "requests": self.gang.requests, "error": self.error}

    async def drain(self, timeout_s: float) -> bool:
        """Close the port at once (new connections are refused), let accepted requests
        finish for at most `timeout_s`; True when the server stopped within it."""
        self.url = None
        if self._server is None or self._task is None:
            return True
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            return True
        except Exception:  # noqa: BLE001 - timed out, or the server failed: it is stopped either way
            return self._task.done()
        finally:
            self.close()

    def close(self) -> None:
        """Stop at once (safe twice, and from __del__): the port closes, requests in flight are cut."""
        self.url = None
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
            for server in getattr(self._server, "servers", ()):
                server.close()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._server = None
