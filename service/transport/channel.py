"""The gang's data channel: request tensors from the ingress to rank 0 over a Unix socket.

Why: on the request path, a Serve handle call (ingress -> GangServer replica) costs
several milliseconds before any work (router, replica queue, Ray task submission and
its reply), which at world size 1 is most of what separates us from a plain one-replica
deployment (bench/NOTES.md, issue 16). When the ingress and rank 0 share a node, the
GangServer replica also listens on a Unix socket and the ingress sends the tensor there
directly. Everything else stays on Serve handles: status, weights, failpoints, and every
request whenever the channel cannot be used (another node, several gangs, autoscaling,
the socket missing or refused); the ingress then falls back to the handle call.

Wire format, both directions, one frame per message:

    u32 header_len | u64 payload_len | header (JSON, UTF-8) | payload (raw bytes)

    request  {"op": "infer", "shape": [b, s, E], "shm": null | "<name in /dev/shm>",
              "mask": false | true, "causal": null | true | false,   (all three optional)
              "timeout_s": null | <seconds left until the request's deadline>}
             payload: the float32 tensor, C order (empty when it travels through shm),
             then, with "mask": true, the key mask [b, s] as bytes 0/1 (always inline)
    request  {"op": "session_append", "shape": [n, E], "session_id": "<id>",
              "length": null | <the session's length before it, a precondition>,
              "idempotency_key": null | "<the append's key>" (service.sessions.keys),
              "timeout_s": null | <seconds left>}
             payload: the rows, float32, C order (always inline: appends are a few rows)
    reply    {"ok": true, "shape": [b, s, E]}     payload: float32 output (empty with shm:
             the output was written into the same shared pages)
             {"ok": true, "shape": [n, E], "session": {...}}  (session_append; the session's
             state after the append, as GET /sessions/{id} shows it)
             {"ok": false, "error": {type, message, code, status, retry_after_s}}
             {"ok": false, "shm_unavailable": "<why>"}  (the client resends inline)

One request at a time per connection (the client keeps a few connections, one per call
in flight). A connection that fails in any way is closed, never reused. A client that
closes its connection while its request is queued or computing (the HTTP client went
away, or the ingress gave up) cancels the request: queued, it is dropped uncomputed.

Drain (`drain()`, the replica's shutdown): stop listening, and close any connection
that sends a new request without answering it (the client falls back
to the Serve handle, which routes to another replica); requests already accepted finish
and get their answers.

Tensors of transport.min_shared_bytes or more travel through a shared region the connection keeps
(service.transport.shm.Arena): the ingress copies the request into it, the gang server maps it on
first use and keeps the mapping, computes on it in place and writes the reply into it,
the ingress copies the reply out. Up to transport.max_shared_region_bytes; larger (rare) requests
go inline, so a connection never pins more than that.

Who may connect: the socket file is created 0600 by the replica's user, and the client
refuses a socket owned by anyone else (a squatter on the predictable path). Sizes are
bounded on both sides (transport.channel_max_header_bytes; the payload must match the shape exactly).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np
import orjson

from service.contract.timing import Part
from service.metrics import timeline
from service.transport import shm
from service.contract.errors import ErrorCode, GangServeError, GangUnavailable, Overloaded, error_from_wire, error_to_wire
from service.config.tunables import TransportTunables

log = logging.getLogger("gangserve.channel")

FRAME = struct.Struct("<IQ")
SOCKET_DIR = shm.SHM_DIR  # per node, shared by every process of the node (and pod)

# rank 0's side: (x [b, s, E] float32 (inline, or a view of shared pages), key mask [b, s]
# bool or None, causal or None, timeout_s=seconds left or None) -> the output
InferFn = Callable[..., Awaitable[np.ndarray]]
# rank 0's side of a session append: (rows [n, E] float32, length precondition or None,
# timeout_s=, session_id=, and idempotency_key= when the frame has one) -> (outputs [n, E], the
# session's state)
SessionAppendFn = Callable[..., Awaitable[tuple[np.ndarray, dict[str, Any]]]]
Region = tuple[str, Any]  # a connection's shared region on rank 0's side: (name, mapping)
Answer = tuple[dict[str, Any], "memoryview | bytes", "Region | None"]  # (reply header, payload, region kept)


class ChannelUnavailable(RuntimeError):
    """The channel cannot carry this call (no socket, refused, closed before a reply):
    the caller sends the request through the Serve handle instead."""


def sweep_stale_sockets(stale_after_s: float) -> int:
    """Remove socket files of replicas that are gone (killed before they could clean up):
    nobody accepts on them, and they are older than `stale_after_s` (transport.stale_socket_s) (so a replica that is
    just starting is never touched). Returns how many were removed."""
    removed = 0
    for path in SOCKET_DIR.glob("gangserve-ch-*.sock"):
        try:
            if time.time() - path.stat().st_mtime < stale_after_s:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.2)
                probe.connect(str(path))
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
        except OSError:
            continue  # not ours to judge (permissions, gone meanwhile, a slow listener)
    return removed


def socket_path(replica_id: str) -> Path:
    """Where the GangServer replica `replica_id` listens (both sides compute it)."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", replica_id):
        raise ValueError(f"replica id {replica_id!r} is not usable in a socket name")
    return SOCKET_DIR / f"gangserve-ch-{replica_id}.sock"


class ChannelServer:
    """Rank 0's listener, inside the GangServer replica's event loop."""

    def __init__(self, infer: InferFn, max_in_flight: int, session_append: SessionAppendFn | None = None,
                 tunables: TransportTunables = TransportTunables(),
                 drop_append_reply: Callable[[], bool] = lambda: False) -> None:
        """`drop_append_reply`: a test's failpoint (service.gang.failpoints), asked after each
        answered session append: True closes the connection instead of writing the reply, as a
        connection lost after the append was committed would."""
        self._max_header = tunables.channel_max_header_bytes
        self._infer = infer
        self._session_append = session_append
        self._drop_append_reply = drop_append_reply
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._server: asyncio.AbstractServer | None = None
        self.path: Path | None = None
        self.requests = 0
        self.refused = 0
        self.disconnected = 0  # requests whose client closed the connection before the answer
        self._draining = False

    async def start(self, replica_id: str) -> bool:
        """Listen at socket_path(replica_id); False (logged) when that is not possible."""
        path = socket_path(replica_id)
        try:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a replica never reuses an id; a leftover is ours to replace
            # Connecting needs write permission on the socket: with the usual umask (022)
            # nobody else has it from the start; 0600 makes that explicit.
            self._server = await asyncio.start_unix_server(self._serve, path=str(path), limit=self._max_header)
            os.chmod(path, 0o600)
        except OSError as exc:
            log.warning("data channel not available (%s); requests use the Serve handle", exc)
            self.close()
            return False
        self.path = path
        return True

    def close(self) -> None:
        """Stop listening and remove the socket file (safe to call twice, also from __del__)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.path = None

    def stats(self) -> dict[str, int]:
        return {"requests": self.requests, "refused_overloaded": self.refused,
                "disconnected": self.disconnected, "in_flight": self._in_flight}

    async def drain(self, timeout_s: float) -> bool:
        """Stop taking requests and wait (at most timeout_s) until the accepted ones are
        answered; True when none is left."""
        self._draining = True
        self.close()
        deadline = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self._in_flight == 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        region: Region | None = None  # this connection's shared region
        try:
            while True:
                try:
                    header, payload = await read_frame(reader, self._max_header)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client closed the connection
                if self._draining:
                    return  # closed unanswered: the client resends through the handle
                # The request's marks on this side (the reply carries them back to the ingress,
                # which shares this host's monotonic clock): the answer's task inherits it.
                marks = timeline.Timeline.starting_now()
                marks.mark(Part.GANG_RECEIVE)
                token = timeline.start(marks)
                answer = asyncio.ensure_future(self._answer(header, payload, region))
                timeline.reset(token)
                # One request per connection at a time: anything readable now is the end
                # of the stream, i.e. the client went away; then the request is cancelled.
                gone = asyncio.ensure_future(reader.read(1))
                await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not answer.done():
                    self.disconnected += 1
                    answer.cancel()
                    with contextlib.suppress(BaseException):
                        await answer
                    return
                gone.cancel()
                with contextlib.suppress(BaseException):
                    await gone
                reply, out, region = answer.result()
                if header.get("op") == "session_append" and reply.get("ok") and self._drop_append_reply():
                    log.warning("failpoint session_append_reply_dropped: closing the connection instead of "
                                "replying to a committed session append")
                    return
                await write_frame(writer, reply, out)
        except (ConnectionError, ValueError) as exc:
            log.debug("data channel connection dropped: %s", exc)
        finally:
            writer.close()

    async def _answer(self, header: dict[str, Any], payload: bytes, region: Region | None) -> Answer:
        """Every op's one admission and error wrapper: the op parses its frame (a malformed
        one, which only a buggy client sends, reaches nothing), the in-flight bound refuses
        it (Overloaded), then it runs; whatever it raises becomes an error reply."""
        try:
            op = header.get("op")
            if op == "infer":
                run = self._infer_op(header, payload, region)
            elif op == "session_append" and self._session_append is not None:
                run = self._append_op(header, payload, region)
            else:
                raise ValueError(f"unknown op {op!r:.50}")
        except ValueError as exc:
            return _error(GangUnavailable(f"bad data-channel request: {exc}", code=ErrorCode.CHANNEL_ERROR)), b"", region
        if self._in_flight >= self._max_in_flight:
            self.refused += 1
            return _error(Overloaded(f"the gang server has {self._in_flight} requests in flight "
                                     f"(max_ongoing_requests + max_queued_requests = {self._max_in_flight})")), b"", region
        self._in_flight += 1
        self.requests += 1
        try:
            return await run()
        except GangServeError as exc:
            return _error(exc), b"", region
        except shm.SharedMemoryUnavailable as exc:
            return {"ok": False, "shm_unavailable": str(exc)}, b"", None
        except Exception as exc:  # noqa: BLE001 - the reply must say something; the log has the rest
            log.exception("data channel %s failed", header.get("op"))
            return _error(GangUnavailable(f"the gang server failed ({type(exc).__name__}); see the service log",
                                          code=ErrorCode.GANG_ERROR)), b"", region
        finally:
            self._in_flight -= 1

    def _infer_op(self, header: dict[str, Any], payload: bytes, region: Region | None
                  ) -> Callable[[], Awaitable[Answer]]:
        """An infer frame (see the wire format) -> the call that answers it; ValueError when malformed."""
        shape = _shape(header.get("shape"))
        name = header.get("shm")
        causal = header.get("causal")
        if causal is not None and not isinstance(causal, bool):
            raise ValueError(f"causal must be null or a boolean, got {causal!r:.50}")
        timeout_s = _timeout(header)
        mask = None
        if header.get("mask"):  # the mask's bytes end the payload
            mask_bytes = shape[0] * shape[1]
            if len(payload) < mask_bytes:
                raise ValueError(f"payload of {len(payload)} bytes cannot hold a [{shape[0]}, {shape[1]}] mask")
            mask = np.frombuffer(payload, dtype=np.bool_, count=mask_bytes,
                                 offset=len(payload) - mask_bytes).reshape(shape[0], shape[1])
            payload = memoryview(payload)[: len(payload) - mask_bytes]
        x = _tensor(payload, shape) if name is None else None

        async def run() -> Answer:
            if x is not None:
                out = np.ascontiguousarray(await self._infer(x, mask, causal, timeout_s=timeout_s), dtype=np.float32)
                return _ok(out.shape), memoryview(out).cast("B"), region
            nbytes = int(np.prod(shape, dtype=np.int64)) * 4
            mapped = region
            if mapped is None or mapped[0] != name or len(mapped[1]) < nbytes:
                mapped = (str(name), shm.map_named(str(name), nbytes))  # kept for the next request
            view = np.frombuffer(mapped[1], dtype=np.float32, count=nbytes // 4).reshape(shape)
            out = await self._infer(view, mask, causal, timeout_s=timeout_s)
            view[...] = out  # the reply goes back in the same pages
            return _ok(out.shape), b"", mapped

        return run

    def _append_op(self, header: dict[str, Any], payload: bytes, region: Region | None
                   ) -> Callable[[], Awaitable[Answer]]:
        """A session_append frame -> the call that answers it (the outputs and the session's
        state); ValueError when malformed."""
        assert self._session_append is not None
        append = self._session_append
        shape = _shape(header.get("shape"), ndim=2)
        session_id, length = header.get("session_id"), header.get("length")
        key = header.get("idempotency_key")
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r:.50}")
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError(f"idempotency_key must be null or a non-empty string, got {key!r:.50}")
        if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
            raise ValueError(f"length must be null or an integer, got {length!r:.50}")
        timeout_s = _timeout(header)
        x = _tensor(payload, shape)

        async def run() -> Answer:
            keyed = {} if key is None else {"idempotency_key": key}  # a frame without one: the call without one
            out, info = await append(x, length, timeout_s=timeout_s, session_id=session_id, **keyed)
            out = np.ascontiguousarray(out, dtype=np.float32)
            return {**_ok(tuple(out.shape)), "session": info}, memoryview(out).cast("B"), region

        return run


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    region: shm.Arena = field(default_factory=shm.Arena)
    answered: bool = False  # the current call got its reply: the connection may be reused


class ChannelClient:
    """The ingress's side: a few pooled connections to one gang server's socket, each with
    its own reusable shared region for tensors that travel through /dev/shm."""

    def __init__(self, path: Path, tunables: TransportTunables = TransportTunables()) -> None:
        self.path = path
        self._max_header = tunables.channel_max_header_bytes
        self._max_region = tunables.max_shared_region_bytes
        self._idle: list[_Connection] = []

    async def infer(self, x: np.ndarray, share: bool = False, mask: np.ndarray | None = None,
                    causal: bool | None = None, timeout_s: float | None = None) -> np.ndarray:
        """x [b, s, E] (+ key mask [b, s] bool, always inline; causal) -> the gang's output,
        x itself in the request (inline), or with `share`
        through the connection's shared region (the output comes back in the same pages
        and is copied out before the connection is reused).

        Raises ChannelUnavailable before a reply (the caller falls back to the handle),
        shm.SharedMemoryUnavailable when the region cannot be made or mapped (the caller
        sends the tensor inline instead), and the gang's own GangServeError as the server
        raised it. Unbounded here: the caller bounds the wait; cancelling it closes the
        connection.
        """
        marks = timeline.current()
        if marks is not None:
            marks.mark(Part.POLICY)  # decoded -> the link starts sending (the request policy's part)
        shape = tuple(int(d) for d in x.shape)
        share = share and x.size * 4 <= self._max_region
        header: dict[str, Any] = {"op": "infer", "shape": list(shape), "shm": None}
        tail = b""
        if mask is not None:
            header["mask"] = True
            tail = np.ascontiguousarray(mask, dtype=np.bool_).tobytes()  # [b, s], one byte each
        if causal is not None:
            header["causal"] = bool(causal)
        if timeout_s is not None:
            header["timeout_s"] = float(timeout_s)  # the seconds left, taken when the frame is written
        async with self._leased() as conn:
            if share:
                try:
                    view = conn.region.view(shape)
                except shm.SharedMemoryUnavailable:
                    conn.answered = True  # nothing was sent: the connection stays usable
                    raise
                view[...] = x
                reply, payload = await self._round_trip(conn, {**header, "shm": conn.region.name}, b"", tail)
            else:
                data = np.ascontiguousarray(x, dtype=np.float32)
                reply, payload = await self._round_trip(conn, header, memoryview(data).cast("B"), tail)
            try:
                out_shape = _shape(reply.get("shape"))
                if not share:
                    out = _tensor(payload, out_shape)
                elif out_shape != shape:
                    raise ValueError(f"reply shape {list(out_shape)} for a {list(shape)} request")
            except ValueError as exc:
                raise ChannelUnavailable(f"malformed data-channel reply: {exc}") from None
            if share:
                conn.region.mapped_by_peer()  # the server holds the pages now: drop the name
                out = view.copy()  # the region is reused by this connection's next request
            if marks is not None:
                marks.mark(Part.LINK_RECEIVE)  # the reply read (and copied out of the region)
            return out

    async def session_append(self, x: np.ndarray, session_id: str, length: int | None = None,
                             timeout_s: float | None = None, idempotency_key: str | None = None
                             ) -> tuple[np.ndarray, dict[str, Any]]:
        """Rows x [n, E] appended to session `session_id` -> (their outputs [n, E], the
        session's state). The rows travel inline. Raises as `infer` does; note that a
        ChannelUnavailable raised while reading the reply says nothing about whether the
        server appended: only the `idempotency_key` makes sending the append again safe."""
        marks = timeline.current()
        if marks is not None:
            marks.mark(Part.POLICY)  # decoded -> the link starts sending (the request policy's part)
        data = np.ascontiguousarray(x, dtype=np.float32)
        header: dict[str, Any] = {"op": "session_append", "shape": [int(d) for d in data.shape],
                                  "session_id": session_id, "length": length, "idempotency_key": idempotency_key}
        if timeout_s is not None:
            header["timeout_s"] = float(timeout_s)
        async with self._leased() as conn:
            reply, payload = await self._round_trip(conn, header, memoryview(data).cast("B"))
            try:
                out = _tensor(payload, _shape(reply.get("shape"), ndim=2))
                info = reply.get("session")
                if not isinstance(info, dict):
                    raise ValueError(f"no session state in the reply (found {info!r:.50})")
            except ValueError as exc:
                raise ChannelUnavailable(f"malformed data-channel reply: {exc}") from None
            if marks is not None:
                marks.mark(Part.LINK_RECEIVE)  # the reply read
            return out, info

    @contextlib.asynccontextmanager
    async def _leased(self) -> AsyncIterator[_Connection]:
        """A pooled connection for one call: back to the pool once the call got its reply
        (or sent nothing); closed when it was cancelled or failed mid-call (the stream is in
        an unknown state). A failed write or read is ChannelUnavailable."""
        conn = await self._connection()
        conn.answered = False
        try:
            yield conn
        except (ConnectionError, OSError) as exc:
            raise ChannelUnavailable(f"data channel write failed: {exc}") from None
        finally:
            if conn.answered:
                self._idle.append(conn)
            else:
                conn.writer.close()
                conn.region.release()

    async def _round_trip(self, conn: _Connection, header: dict[str, Any], payload: memoryview | bytes,
                          tail: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """One request frame, its reply frame; the server's error replies raised (its
        GangServeError as it raised it, SharedMemoryUnavailable when it could not map the region)."""
        marks = timeline.current()
        if marks is not None:
            # Before the write, never after: the server may read the frame (and mark its
            # gang_receive) before this task runs again. The socket's transit is gang_receive.
            marks.mark(Part.LINK_SEND)  # the tensor in the shared region, the frame about to go
        await write_frame(conn.writer, header, payload, tail)
        reply, out = await _read_reply(conn, self._max_header)
        conn.answered = True
        if marks is not None:
            marks.extend(_marks(reply.get("marks")))
        if not reply.get("ok"):
            if "shm_unavailable" in reply:
                conn.region.release()  # the server could not map it: a new region next time
                raise shm.SharedMemoryUnavailable(str(reply["shm_unavailable"]))
            raise error_from_wire(reply.get("error") or {})
        return reply, out

    def close(self) -> None:
        for conn in self._idle:
            conn.writer.close()
            conn.region.release()
        self._idle = []

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                return conn
            conn.writer.close()
            conn.region.release()
        try:
            owner = self.path.stat().st_uid
        except OSError as exc:
            raise ChannelUnavailable(f"no data channel at {self.path.name}: {exc.strerror}") from None
        if owner != os.getuid():
            raise ChannelUnavailable(f"{self.path.name} belongs to uid {owner}, not to this service's user")
        try:
            reader, writer = await asyncio.open_unix_connection(str(self.path), limit=self._max_header)
        except OSError as exc:
            raise ChannelUnavailable(f"cannot connect to {self.path.name}: {exc.strerror or exc}") from None
        return _Connection(reader, writer)


async def read_frame(reader: asyncio.StreamReader, max_header_bytes: int) -> tuple[dict[str, Any], bytes]:
    """One frame; a header longer than `max_header_bytes` is refused (ValueError)."""
    head = await reader.readexactly(FRAME.size)
    header_len, payload_len = FRAME.unpack(head)
    if header_len > max_header_bytes:
        raise ValueError(f"data-channel header of {header_len} bytes (max {max_header_bytes})")
    header = orjson.loads(await reader.readexactly(header_len))
    if not isinstance(header, dict):
        raise ValueError("data-channel header is not an object")
    payload = await reader.readexactly(payload_len) if payload_len else b""
    return header, payload


async def write_frame(writer: asyncio.StreamWriter, header: dict[str, Any], payload: memoryview | bytes,
                      tail: bytes = b"") -> None:
    """One frame; the payload is `payload` then `tail` (the mask's bytes), written without joining them."""
    head = orjson.dumps(header)
    writer.write(FRAME.pack(len(head), len(payload) + len(tail)) + head)
    if len(payload):
        writer.write(payload)
    if tail:
        writer.write(tail)
    await writer.drain()


async def _read_reply(conn: _Connection, max_header_bytes: int) -> tuple[dict[str, Any], bytes]:
    """The server's reply frame; ChannelUnavailable when the connection closed or the frame is malformed."""
    try:
        return await read_frame(conn.reader, max_header_bytes)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ChannelUnavailable(f"the gang server closed the data channel ({type(exc).__name__})") from None
    except ValueError as exc:
        raise ChannelUnavailable(f"malformed data-channel reply: {exc}") from None


def _shape(value: Any, ndim: int = 3) -> tuple[int, ...]:
    """A tensor's shape from a header: `ndim` non-negative ints ([batch, seq, E], or a session's [n, E])."""
    if not (isinstance(value, list) and len(value) == ndim
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in value)):
        what = "[batch, seq, E]" if ndim == 3 else "[n, E]"
        raise ValueError(f"shape must be {what} of non-negative ints, got {value!r:.80}")
    return tuple(value)


def _tensor(payload: bytes, shape: tuple[int, ...]) -> np.ndarray:
    expected = int(np.prod(shape, dtype=np.int64)) * 4
    if len(payload) != expected:
        raise ValueError(f"payload of {len(payload)} bytes for a float32 tensor of shape {list(shape)} ({expected})")
    return np.frombuffer(payload, dtype=np.float32).reshape(shape)


def _ok(shape: tuple[int, ...]) -> dict[str, Any]:
    """An infer or session_append reply's header, with this side's marks of the request (service.metrics.timeline)."""
    marks = timeline.current()
    if marks is None:
        return {"ok": True, "shape": list(shape)}
    marks.mark(Part.REPLY)  # the step's end -> the reply is about to be written
    return {"ok": True, "shape": list(shape), "marks": marks.marks}


_PART_NAMES = frozenset(part.value for part in Part)


def _marks(value: Any) -> list[tuple[Part, int]]:
    """The server's marks from a reply header; [] when absent or malformed (timing is never
    a reason to fail a request)."""
    if not isinstance(value, list):
        return []
    marks = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and item[0] in _PART_NAMES and isinstance(item[1], int)):
            return []
        marks.append((Part(item[0]), item[1]))
    return marks


def _timeout(header: dict[str, Any]) -> float | None:
    """A frame's `timeout_s`: null or a number of seconds (ValueError otherwise)."""
    timeout_s = header.get("timeout_s")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))):
        raise ValueError(f"timeout_s must be null or a number, got {timeout_s!r:.50}")
    return timeout_s


def _error(exc: GangServeError) -> dict[str, Any]:
    return {"ok": False, "error": error_to_wire(exc)}
