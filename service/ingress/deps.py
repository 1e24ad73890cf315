"""FastAPI dependencies: the gang (a Protocol: what the routes call), the fleet, the config, a size-capped body reader, and the
bounded pool that does heavy decoding off the event loop."""
from __future__ import annotations

import asyncio
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, TypeVar

import numpy as np
from fastapi import Request

from service.config.builder_args import AppConfig
from service.contract.errors import BadRequest, ErrorCode, GangServeError, GangUnavailable, Overloaded, PayloadTooLarge
from service.contract.gang_status import GangAnswer, GangStatus, GangsView
from service.ingress.diagnosis import Diagnosis
from service.ingress.fleet_client import FleetClient
from service.ingress.retries import GangMethod
from service.config.tunables import Tunables

T = TypeVar("T")
log = logging.getLogger("gangserve.ingress")

# Bodies up to this size in a binary format are decoded inline: a zero-copy view and a
# float32 check costs less than a hop to a thread. Replies of as many float32 values are
# encoded inline (one tunable, the other derived from it).


# Dependencies are `async def` on purpose: FastAPI runs a plain `def` dependency in a
# thread pool, a thread hop per dependency per request (the profile: bench/NOTES.md;
# tests/test_layout.py keeps them async).
async def get_config(request: Request) -> AppConfig:
    return request.app.state.config


class Gang(Protocol):
    """What the routes ask of the gang (service.ingress.requests.RequestPolicy in the service;
    a test may hand the routes any object with these methods)."""

    async def infer(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    deadline: float | None = None) -> np.ndarray: ...

    async def session_call(self, method: GangMethod, *args: Any, session_id: str | None, deadline: float,
                           **kwargs: Any) -> Any: ...

    async def describe(self) -> GangAnswer: ...


class Weights(Protocol):
    """What POST /weights asks of the gang (service.ingress.weights_admin.WeightsAdmin)."""

    async def reload_weights(self, checkpoint: str | None, job_id: str | None = None,
                             eval_loss: float | None = None) -> GangStatus: ...

    async def rollback_weights(self, version: int) -> GangStatus: ...


class FleetReader(Protocol):
    """What readiness and GET /gangs ask of the fleet view (service.ingress.fleet_client.FleetClient)."""

    tunables: Tunables
    diagnosis: Diagnosis

    async def gangs(self, for_readiness: bool = False) -> GangsView: ...


async def get_gang(request: Request) -> Gang:
    return request.app.state.gang


async def get_weights(request: Request) -> Weights:
    return request.app.state.weights


async def get_fleet(request: Request) -> FleetClient:
    return request.app.state.fleet


async def get_decode_pool(request: Request) -> "DecodePool":
    return request.app.state.decode_pool


def check_declared_length(request: Request, max_bytes: int, limit_name: str = "max_body_bytes") -> None:
    """413 (before any byte is read) when Content-Length says the body is over `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is None:
        return
    try:
        length = int(declared)
    except ValueError:
        raise BadRequest(f"Content-Length {declared[:40]!r} is not an integer") from None
    if length > max_bytes:
        raise PayloadTooLarge(f"body is {length} bytes; the limit is {limit_name}={max_bytes}")


async def read_body_capped(request: Request, max_bytes: int, limit_name: str = "max_body_bytes") -> bytes:
    """The request body, refusing (413) as soon as it is known to exceed max_bytes.

    A declared Content-Length above the cap is refused before any byte is read; a
    chunked body is refused as soon as the running total passes the cap.
    """
    check_declared_length(request, max_bytes, limit_name)
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise PayloadTooLarge(f"body exceeds {limit_name}={max_bytes}")
        chunks.append(chunk)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) != total:
        # The HTTP server enforces Content-Length, so a mismatch here means the body was lost
        # on its way through Serve (seen when an ingress replica dies mid-request and the
        # proxy hands the request to another one): a retry will do, the input is not at fault.
        raise GangUnavailable(
            f"the request body arrived incomplete ({total} of {declared} bytes); retry",
            code=ErrorCode.INCOMPLETE_BODY, retry_after_s=1.0,
        )
    return b"".join(chunks)


# An HTTP/1.x request line: what a body holds when the connection that carried it lost its
# framing on the way (the front door handed this replica a request whose body was cut short,
# and the next request on that connection was read as its remainder).
_REQUEST_LINE = re.compile(rb"(?:GET|HEAD|POST|PUT|PATCH|DELETE|OPTIONS) /[^ \r\n]{0,2048} HTTP/1\.[01]\r\n")


def request_line_in(body: bytes) -> re.Match[bytes] | None:
    """Another HTTP request's request line inside `body` (then it is not the body its client
    sent), or None. Looked for only once a decode has failed, never on the success path."""
    return _REQUEST_LINE.search(body)


class DecodePool:
    """A few threads for CPU-heavy request work (JSON parsing, decompression, conversion of
    large bodies, JSON encoding of large replies), so the event loop keeps serving.

    Admission is bounded: at most `max_pending` submissions are running or queued; one
    more is refused at once with 503 `overloaded` + Retry-After. A slot is freed when its
    work has really finished in the thread (not when a disconnected client's task is
    cancelled), so the bound holds for the threads themselves.

    What the bound buys: parsing in a thread still holds the interpreter lock for the
    length of one C call (orjson parses a whole body in one call), so the loop can stall
    for up to one body's parse time (docs/api.md, "Codec timings"); numpy conversion runs
    in chunks (gangserve_client.codecs.JSON_CHUNK_VALUES) and zlib inflation releases the lock.
    """

    def __init__(self, threads: int, max_pending: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gangserve-decode")
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self.refused = 0

    @property
    def pending(self) -> int:
        return self._pending

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a pool thread; 503 overloaded when the pool is full."""
        with self._lock:
            if self._pending >= self._max_pending:
                self.refused += 1
                raise Overloaded(
                    f"{self._pending} requests are being decoded (max_pending_decodes={self._max_pending}); "
                    "retry shortly"
                )
            self._pending += 1
        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)
        return await asyncio.wrap_future(future)

    async def decode(self, fn: Callable[..., T], body: bytes, *args: Any, inline: bool) -> T:
        """fn(body, *args): the body's decode, `inline` on the event loop or else in a pool thread
        (`run`). A client error (4xx) from a body that arrived mixed with another HTTP request
        (`request_line_in`) is the transport's fault, not the client's: it becomes a 503
        `incomplete_body` (retryable) instead, and the replica logs the body's first bytes."""
        try:
            return fn(body, *args) if inline else await self.run(fn, body, *args)
        except GangServeError as exc:
            line = request_line_in(body) if 400 <= exc.status < 500 else None
            if line is None:
                raise
            at = line.start()
            # The request line and the bytes before it only: the other request's headers
            # after it may carry its client's token.
            log.warning("a %d-byte body holds another HTTP request's line %r at byte %d (decode said: %s); "
                        "it starts %r", len(body), line.group().strip(), at, exc, body[:min(at, 64)])
            raise GangUnavailable(
                f"the request body arrived mixed with another HTTP request's bytes (its request line at byte "
                f"{at} of {len(body)}): a connection fault between the front door and this replica; retry",
                code=ErrorCode.INCOMPLETE_BODY, retry_after_s=1.0,
            ) from None

    async def run_unbounded(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a pool thread without admission control: for work a request already
        admitted must finish (encoding its reply), so it is never refused after compute."""
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    def _release(self, _: object) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
