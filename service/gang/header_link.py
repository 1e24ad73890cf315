"""Rank 0's headers to the peers' step loops: one TCP connection per peer, not a collective.

What goes over it, in this order per step: the header; an append step's plan
(`Rank.broadcast_control`); a step's input when it is at most `DATA_MAX_BYTES` and every rank
computes on CPU (`carries_data`, agreed at connection: each peer's hello says whether it is on
CPU, rank 0 answers every peer with the gang's one decision; a CUDA rank's input would be staged
through host memory both ways, slower than gloo's own CUDA broadcast). Larger inputs and every
all_reduce stay on the process group.

Why not the control group's gloo broadcast: a gloo collective is handed to the process
group's worker thread and back on each side, and a waiting peer is woken by gloo's I/O thread,
which wakes the worker thread, which wakes the loop thread: four thread wake-ups per header
between rank 0's send and the peer holding it. Over a socket rank 0's `sendall` returns
without a hand-off and the peer's blocking `recv_into` is woken by the kernel directly (one
wake-up, no spinning). The connections are made at rendezvous through the gang's store (rank 0
listens on its node's address, an OS-chosen port, and publishes it under `STORE_KEY`), so they
reach peers on other nodes as the process group does.

Every wait is bounded by the gang's collective timeout (the control group's): a peer's read
times out after it (rank 0 stopped), and ends at once when rank 0's process is gone (its
connection closes); rank 0's send to a peer that stopped reading times out the same way once
the socket's buffer is full (a header is `HEADER_BYTES`: thousands fit).
"""
from __future__ import annotations

import socket
import struct
import time

import torch

from service.gang import control

STORE_KEY = "gang/header_port"
HEADER_BYTES = control.HEADER_LEN * 8  # int64 values
# A step input this small goes over the link (one peer wake for header and data); it fits the
# sockets' buffers, so rank 0's sends never wait for a peer to read (larger ones would, one peer
# after the other, where gloo's broadcast sends to every peer at once).
DATA_MAX_BYTES = 64 * 1024
_HELLO = struct.Struct("<qq")  # a peer's first message: its rank, 1 if it computes on CPU
_ANSWER = struct.Struct("<q")  # rank 0's answer to every peer: 1 if the link carries small inputs


def _tuned(sock: socket.socket, timeout_s: float) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a header goes out at once
    sock.settimeout(timeout_s)
    return sock


class HeaderListener:
    """Rank 0 at rendezvous: listens on `node_ip`, then accepts every peer's connection."""

    def __init__(self, node_ip: str) -> None:
        family = socket.AF_INET6 if ":" in node_ip else socket.AF_INET
        self._sock = socket.create_server((node_ip, 0), family=family, backlog=64)
        self.port: int = self._sock.getsockname()[1]

    def accept(self, peers: int, timeout_s: float, on_cpu: bool) -> HeaderSender:
        """The `peers` connections (ranks 1..peers), within timeout_s in all; raises TimeoutError
        naming the ranks still missing. `on_cpu`: rank 0's own device; the link carries small
        inputs when it and every peer compute on CPU (each peer is told)."""
        deadline = time.monotonic() + timeout_s
        by_rank: dict[int, socket.socket] = {}
        all_cpu = on_cpu
        try:
            while len(by_rank) < peers:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, peers + 1)) - set(by_rank))
                    raise TimeoutError(f"rank 0's header link: ranks {missing} did not connect within {timeout_s:.1f}s")
                self._sock.settimeout(left)
                try:
                    conn, _ = self._sock.accept()
                except socket.timeout:
                    continue
                _tuned(conn, timeout_s)
                rank, peer_cpu = _HELLO.unpack(_read_exactly(conn, _HELLO.size, "a peer's hello"))
                all_cpu = all_cpu and bool(peer_cpu)
                if not 1 <= rank <= peers or rank in by_rank:
                    conn.close()
                    raise RuntimeError(f"rank 0's header link: a peer said it is rank {rank}; expected one of "
                                       f"1..{peers} not yet connected (connected: {sorted(by_rank)})")
                by_rank[rank] = conn
            for conn in by_rank.values():
                conn.sendall(_ANSWER.pack(int(all_cpu)))
        except BaseException:
            for conn in by_rank.values():
                conn.close()
            raise
        finally:
            self._sock.close()
        return HeaderSender([by_rank[r] for r in sorted(by_rank)], all_cpu)


class HeaderSender:
    """Rank 0: one header to every peer, in rank order."""

    def __init__(self, conns: list[socket.socket], carries_data: bool) -> None:
        self._conns = conns
        self.carries_data = carries_data  # small step inputs go over the link (every rank on CPU)

    def send(self, header: torch.Tensor) -> None:
        if header.numel() * header.element_size() != HEADER_BYTES:
            raise ValueError(f"a header is {HEADER_BYTES} bytes ({control.HEADER_LEN} int64); "
                             f"got {header.numel() * header.element_size()}")
        self.send_tensor(header, "header")

    def send_tensor(self, values: torch.Tensor, what: str = "step's data") -> None:
        """`values` (a CPU tensor, sent as its raw bytes) to every peer; the peers know its size."""
        data = values.contiguous().view(torch.uint8).numpy().tobytes() if values.numel() else b""
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.sendall(data)
            except OSError as exc:  # socket.timeout included
                raise RuntimeError(f"sending the {what} ({len(data)} bytes) to rank {rank} failed: "
                                   f"{type(exc).__name__}: {exc}") from exc

    def broadcast(self, values: torch.Tensor, what: str) -> None:
        """Rank 0's end of a broadcast over the link (a peer's end: `HeaderReceiver.broadcast`)."""
        self.send_tensor(values, what)

    def close(self) -> None:
        for conn in self._conns:
            _close(conn)


class HeaderReceiver:
    """A peer: its connection to rank 0; `receive` blocks for the next header."""

    def __init__(self, host: str, port: int, rank: int, on_cpu: bool, timeout_s: float) -> None:
        """Connects and says hello; returns once rank 0 answered (it answers when every peer
        connected), each read bounded by timeout_s."""
        self._sock = _tuned(socket.create_connection((host, port), timeout=timeout_s), timeout_s)
        self._timeout_s = timeout_s
        try:
            self._sock.sendall(_HELLO.pack(rank, int(on_cpu)))
            answer = _ANSWER.unpack(_read_exactly(self._sock, _ANSWER.size, "rank 0's answer"))[0]
        except BaseException:
            self._sock.close()
            raise
        self.carries_data = bool(answer)  # small step inputs come over the link (every rank on CPU)

    def receive(self, into: torch.Tensor, spin_ns: int = 0) -> None:
        """The next header into `into` (HEADER_LEN int64). First polls without blocking up to
        spin_ns (a header that comes within it skips this thread's sleep and wake-up, at up to
        that much of a core), then blocks, each read bounded by the collective timeout.
        Raises ConnectionError when rank 0's side closed, TimeoutError when nothing came."""
        if into.numel() * into.element_size() != HEADER_BYTES:
            raise ValueError(f"a header is {HEADER_BYTES} bytes ({control.HEADER_LEN} int64); "
                             f"the buffer holds {into.numel() * into.element_size()}")
        self.receive_tensor(into, spin_ns, "header")

    def receive_tensor(self, into: torch.Tensor, spin_ns: int = 0, what: str = "step's data") -> None:
        """Rank 0's next `into.numel()` values (what its `send_tensor` sent) into `into`, a
        contiguous CPU tensor; polls and bounds as `receive`."""
        view = memoryview(into.view(torch.uint8).numpy()).cast("B") if into.numel() else memoryview(b"")
        size, got = len(view), 0
        if spin_ns > 0 and got < size:
            # Non-blocking while polling: a socket with a timeout waits in poll() before every
            # read, whatever MSG_DONTWAIT says.
            self._sock.settimeout(0.0)
            try:
                until = time.perf_counter_ns() + spin_ns
                while got < size and time.perf_counter_ns() < until:
                    try:
                        n = self._sock.recv_into(view[got:], size - got)
                    except BlockingIOError:
                        continue
                    if n == 0:
                        raise ConnectionError(f"rank 0 closed the header link after {got} of the {what}'s {size} bytes")
                    got += n
            finally:
                self._sock.settimeout(self._timeout_s)
        while got < size:
            try:
                n = self._sock.recv_into(view[got:], size - got)
            except socket.timeout:
                raise TimeoutError(f"no {what} from rank 0 within the collective timeout "
                                   f"{self._timeout_s:.1f}s ({got} of {size} bytes)") from None
            if n == 0:
                raise ConnectionError(f"rank 0 closed the header link after {got} of the {what}'s {size} bytes "
                                      "(its process is gone or it left the gang)")
            got += n

    def broadcast(self, values: torch.Tensor, what: str) -> None:
        """A peer's end of a broadcast over the link: rank 0's `values` into `values`."""
        self.receive_tensor(values, what=what)

    def close(self) -> None:
        _close(self._sock)


def _read_exactly(conn: socket.socket, n: int, what: str) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"rank 0's header link: the connection closed before {what} ({len(data)} of {n} bytes)")
        data += chunk
    return data


def _close(sock: socket.socket) -> None:
    """Shut down first: a thread blocked reading this socket wakes (end of stream) rather than
    keeping it open."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected any more
    sock.close()
