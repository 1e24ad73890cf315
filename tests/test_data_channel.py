"""The data channel: ingress -> rank 0 over a Unix socket (service.transport.channel).

Unit tests run a real ChannelServer and ChannelClient over a real socket in a temporary
directory, with a real computation behind the server (numpy arithmetic, and the real
service.transport.shm hand-off); Ray tests drive the ingress's GangClient against the deployed
gang, whose results are checked against the independent dense reference.
"""
from __future__ import annotations

import asyncio
import io
import os
import socket
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import httpx
import numpy as np
import pytest

from service.config.tunables import TransportTunables
import torch

from service.transport import channel, shm
from service.transport.channel import ChannelClient, ChannelServer, ChannelUnavailable
from service.contract.errors import CollectiveTimeout, GangUnavailable, Overloaded
from tests.faults import driver_side_policy, transport_used
from tests.reference import reference, relative_error
from tests.helpers import eventually_async, rand


# -- unit: a real server and client over a real socket ---------------------------------

def _affine(x: np.ndarray) -> np.ndarray:
    """What the test server computes: y = 2x + 1 (any exact, checkable function will do)."""
    return 2.0 * x + 1.0


def _run_with_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: Callable[[ChannelServer, ChannelClient], Awaitable[Any]],
    infer: Callable[..., Awaitable[np.ndarray]] | None = None, max_in_flight: int = 8,
) -> Any:
    monkeypatch.setattr(channel, "SOCKET_DIR", tmp_path)

    async def default_infer(x: np.ndarray, mask: Any = None, causal: Any = None, timeout_s: Any = None) -> np.ndarray:
        return _affine(x)

    async def main() -> Any:
        server = ChannelServer(infer or default_infer, max_in_flight=max_in_flight)
        assert await server.start("replica1")
        client = ChannelClient(channel.socket_path("replica1"))
        try:
            return await body(server, client)
        finally:
            client.close()
            server.close()

    return asyncio.run(main())


@pytest.mark.unit
def test_inline_round_trip_concurrent_calls_and_socket_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    xs = [rand(b, 3, 8, seed=b) for b in (1, 2, 5)]

    async def body(server: ChannelServer, client: ChannelClient) -> None:
        path = channel.socket_path("replica1")
        assert path.stat().st_mode & 0o777 == 0o600  # nobody else may connect
        outs = await asyncio.gather(*(client.infer(x) for x in xs))  # three connections at once
        for x, out in zip(xs, outs):
            assert isinstance(out, np.ndarray) and np.array_equal(out, _affine(x))
        again = await client.infer(xs[0])  # a pooled connection is reused
        assert np.array_equal(again, _affine(xs[0]))
        assert server.stats()["requests"] == 4

    _run_with_server(tmp_path, monkeypatch, body)
    assert not channel.socket_path("replica1").exists()  # close() removes the socket file


@pytest.mark.unit
def test_shared_region_is_reused_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large tensors go through the connection's shared region: the server computes on the
    mapped pages and answers in them; the region's name is gone from /dev/shm once the
    server holds it, and the next request on the connection reuses the same pages."""
    if not shm.available():
        pytest.skip("needs a writable /dev/shm")
    seen: list[np.ndarray] = []

    async def infer(x: np.ndarray, mask: Any = None, causal: Any = None, timeout_s: Any = None) -> np.ndarray:
        seen.append(x)
        return _affine(x)

    def ours() -> set[str]:
        return {p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}{os.getpid()}-*")}

    async def body(_: ChannelServer, client: ChannelClient) -> None:
        first, second = rand(2, 16, 512, seed=3), rand(1, 8, 512, seed=4)  # 64 KiB and 16 KiB
        out = await client.infer(first, share=True)
        assert np.array_equal(out, _affine(first))
        assert not ours()  # the name was removed as soon as the server had the pages
        region = client._idle[0].region
        name, capacity = region.name, region.capacity
        out2 = await client.infer(second, share=True)
        assert np.array_equal(out2, _affine(second))
        assert (region.name, region.capacity) == (name, capacity)  # same pages, no new file
        assert np.array_equal(out, _affine(first))  # replies are copies: reuse cannot touch them
        assert not seen[0].flags.owndata  # the server computed on the mapped pages themselves
        big = rand(8, 64, 512, seed=5)  # 1 MiB: still fits the first region (1 MiB minimum)
        bigger = rand(16, 64, 512, seed=6)  # 2 MiB: a larger region replaces it
        assert np.array_equal(await client.infer(big, share=True), _affine(big))
        assert np.array_equal(await client.infer(bigger, share=True), _affine(bigger))
        assert region.name != name and region.capacity >= bigger.nbytes and not ours()

    _run_with_server(tmp_path, monkeypatch, body, infer=infer)


@pytest.mark.unit
def test_gang_errors_cross_with_type_code_and_retry_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    errors = iter([
        GangUnavailable("gang is rebuilding: a rank died", code="gang_rebuilding", retry_after_s=7.0),
        CollectiveTimeout("a collective timed out"),
    ])

    async def failing(_: np.ndarray, mask: Any = None, causal: Any = None, timeout_s: Any = None) -> np.ndarray:
        raise next(errors)

    async def body(_: ChannelServer, client: ChannelClient) -> None:
        with pytest.raises(GangUnavailable) as first:
            await client.infer(rand(1, 2, 8))
        assert (first.value.status, first.value.code, first.value.retry_after_s) == (503, "gang_rebuilding", 7.0)
        assert "a rank died" in first.value.message
        with pytest.raises(CollectiveTimeout) as second:
            await client.infer(rand(1, 2, 8))
        assert second.value.status == 504

    _run_with_server(tmp_path, monkeypatch, body, infer=failing)


@pytest.mark.unit
def test_more_calls_than_max_in_flight_are_refused_as_overloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = asyncio.Event()

    async def slow(x: np.ndarray, mask: Any = None, causal: Any = None, timeout_s: Any = None) -> np.ndarray:
        await release.wait()
        return _affine(x)

    async def body(server: ChannelServer, client: ChannelClient) -> None:
        first = asyncio.ensure_future(client.infer(rand(1, 2, 8)))
        await eventually_async(lambda: server.stats()["in_flight"] >= 1, 5, "the first call holding the only slot")
        with pytest.raises(Overloaded) as refused:
            await client.infer(rand(1, 2, 8))
        assert refused.value.status == 503 and refused.value.retry_after_s
        release.set()
        assert np.array_equal(await first, _affine(rand(1, 2, 8)))
        assert server.stats()["refused_overloaded"] == 1

    _run_with_server(tmp_path, monkeypatch, body, infer=slow, max_in_flight=1)


@pytest.mark.unit
def test_no_socket_a_foreign_owner_or_a_server_that_dies_is_channel_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(channel, "SOCKET_DIR", tmp_path)

    async def main() -> None:
        with pytest.raises(ChannelUnavailable, match="no data channel"):
            await ChannelClient(channel.socket_path("nobody")).infer(rand(1, 2, 8))

        async def dies(_: np.ndarray, mask: Any = None, causal: Any = None, timeout_s: Any = None) -> np.ndarray:
            # The connection's handler ends without a reply, as when the replica dies.
            raise asyncio.CancelledError()

        server = ChannelServer(dies, max_in_flight=4)
        assert await server.start("replica2")
        client = ChannelClient(channel.socket_path("replica2"))
        with pytest.raises(ChannelUnavailable, match="closed the data channel"):
            await asyncio.wait_for(client.infer(rand(1, 2, 8)), timeout=30)
        client.close()

    asyncio.run(main())
    if os.getuid() != 0:
        return  # only root can give a file away
    squatter = channel.socket_path("replica3")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(squatter))
        os.chown(squatter, 65534, -1)
        with pytest.raises(ChannelUnavailable, match="belongs to uid 65534"):
            asyncio.run(ChannelClient(squatter).infer(rand(1, 2, 8)))


@pytest.mark.unit
def test_malformed_requests_get_an_error_reply_or_a_closed_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(server: ChannelServer, _: ChannelClient) -> None:
        path = str(channel.socket_path("replica1"))
        reader, writer = await asyncio.open_unix_connection(path)
        # The payload does not match the declared shape: an error reply, connection kept.
        await channel.write_frame(writer, {"op": "infer", "shape": [1, 2, 8], "shm": None}, b"\0" * 12)
        reply, _ = await channel.read_frame(reader, TransportTunables().channel_max_header_bytes)
        assert reply["ok"] is False and reply["error"]["code"] == "channel_error"
        assert "payload of 12 bytes" in reply["error"]["message"]
        await channel.write_frame(writer, {"op": "infer", "shape": [1, -2, 8], "shm": None}, b"")
        reply, _ = await channel.read_frame(reader, TransportTunables().channel_max_header_bytes)
        assert reply["ok"] is False and "shape must be" in reply["error"]["message"]
        # A header over the limit: the server hangs up without reading it.
        writer.write(channel.FRAME.pack(TransportTunables().channel_max_header_bytes + 1, 0))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), timeout=10) == b""
        writer.close()
        assert server.stats()["requests"] == 0  # nothing reached the gang

    _run_with_server(tmp_path, monkeypatch, body)


@pytest.mark.unit
def test_sweep_removes_only_old_sockets_nobody_listens_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel, "SOCKET_DIR", tmp_path)
    old = time.time() - 2 * TransportTunables().stale_socket_s
    dead, young, live = (channel.socket_path(n) for n in ("dead", "young", "live"))
    listener = socket.socket(socket.AF_UNIX)
    for path in (dead, young):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))  # bound, never listening, closed: nobody accepts there
    listener.bind(str(live))
    listener.listen()
    try:
        os.utime(dead, (old, old))
        os.utime(live, (old, old))
        assert channel.sweep_stale_sockets(TransportTunables().stale_socket_s) == 1
        assert not dead.exists() and young.exists() and live.exists()
    finally:
        listener.close()


# -- ray: the ingress's request policy against the deployed gang -----------------------------

@pytest.mark.ray
def test_requests_take_the_data_channel_and_match_the_reference(app_url: str) -> None:
    client = driver_side_policy(app_url)
    big, small = rand(3, 32, 512, seed=21), rand(1, 4, 512, seed=22)  # 192 KiB (shm), 8 KiB (inline)

    async def run() -> list[np.ndarray]:
        return [np.array(await client.infer(big)), np.array(await client.infer(small))]

    out_big, out_small = asyncio.run(run())
    assert relative_error(torch.from_numpy(out_big), reference(big)) < 1e-5
    assert relative_error(torch.from_numpy(out_small), reference(small)) < 1e-5
    t = client._link.transport().model_dump()
    assert (t["data_channel"], t["shared_memory"], t["object_store"], t["data_channel_fallbacks"]) == (2, 1, 0, 0), t
    gang = httpx.get(app_url + "/gang", timeout=30).json()
    assert gang["data_channel"]["listening"] is True and gang["data_channel"]["requests"] >= 2


@pytest.mark.ray
def test_session_appends_take_the_data_channel_and_match_causal_attention(app_url: str) -> None:
    """A session's appends travel over the data channel when it is the route (one gang, rank
    0 on this node): three appends of 3, 1 and 3 rows give the rows of causal attention over
    the whole 7-row sequence (the dense reference), and the session's state comes back too."""
    client = driver_side_policy(app_url)
    rows = rand(1, 7, 512, seed=31)[0]  # [7, E]

    async def run() -> tuple[np.ndarray, dict]:
        deadline = time.monotonic() + 60
        _, opened = await client.session_call("session_open", None, session_id=None, deadline=deadline)
        sid, outs, info = opened["session_id"], [], opened
        for part in (rows[:3], rows[3:4], rows[4:]):
            out, info = await client.session_call("session_append", part, info["length"], session_id=sid,
                                                  deadline=deadline)
            outs.append(np.array(out))
        await client.session_call("session_close", session_id=sid, deadline=deadline)
        return np.concatenate(outs), info

    out, info = asyncio.run(run())
    assert relative_error(torch.from_numpy(out), reference(rows, causal=True)) < 1e-5
    assert info["length"] == 7, info
    t = client._link.transport().model_dump()
    assert (t["data_channel"], t["data_channel_fallbacks"], t["object_store"]) == (3, 0, 0), t


@pytest.mark.unit
def test_a_session_append_crosses_the_channel_with_its_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session op's wire: rows [n, E] and the length precondition to rank 0's side, the
    outputs and the session's state back; a malformed one gets an error reply, not a crash."""
    monkeypatch.setattr(channel, "SOCKET_DIR", tmp_path)
    seen: list[tuple] = []

    async def append(x: np.ndarray, length: int | None, timeout_s: float | None = None,
                     session_id: str = "") -> tuple[np.ndarray, dict]:
        seen.append((x.shape, length, session_id, timeout_s is not None))
        return _affine(x), {"session_id": session_id, "length": (length or 0) + x.shape[0]}

    async def main() -> None:
        async def infer(x: np.ndarray, mask: Any = None, causal: Any = None, timeout_s: Any = None) -> np.ndarray:
            return _affine(x)

        server = ChannelServer(infer, max_in_flight=4, session_append=append)
        assert await server.start("sess")
        client = ChannelClient(channel.socket_path("sess"))
        try:
            x = rand(1, 5, 8, seed=2)[0]
            out, info = await client.session_append(x, "r-abc", 3, timeout_s=9.0)
            np.testing.assert_array_equal(out, _affine(x))
            assert info == {"session_id": "r-abc", "length": 8}
            with pytest.raises(GangUnavailable, match="session_id"):
                await client.session_append(x, "", None)
        finally:
            client.close()
            server.close()

    asyncio.run(main())
    assert seen == [((5, 8), 3, "r-abc", True)]


@pytest.mark.ray
def test_an_unusable_channel_falls_back_to_the_handle(app_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = driver_side_policy(app_url)
    monkeypatch.setattr(channel, "SOCKET_DIR", tmp_path)  # as if the socket were gone
    x = rand(1, 4, 512, seed=23)

    async def run() -> list[np.ndarray]:
        return [np.array(await client.infer(x)), np.array(await client.infer(x))]

    for out in asyncio.run(run()):
        assert relative_error(torch.from_numpy(out), reference(x)) < 1e-5
    # One failed attempt, then the handle without retrying the channel for a while.
    t = client._link.transport().model_dump()
    assert (t["data_channel"], t["data_channel_fallbacks"], t["object_store"]) == (1, 1, 2), t


@pytest.mark.ray
def test_data_channel_off_uses_the_handle(app_url: str) -> None:
    client = driver_side_policy(app_url, data_channel=False)
    x = rand(1, 4, 512, seed=24)
    out = np.array(asyncio.run(client.infer(x)))
    assert relative_error(torch.from_numpy(out), reference(x)) < 1e-5
    used = transport_used(client)
    assert (used["data_channel"], used["object_store"]) == (0, 1), used


@pytest.mark.ray
def test_request_path_replicas_run_on_their_main_event_loop(app_url: str) -> None:
    """same_event_loop (default): the GangServer replica (rank 0's process) starts with Serve's
    switches that run our code and the handle router on the replica's main loop."""
    from service.app import SAME_EVENT_LOOP_ENV

    pid = httpx.get(app_url + "/gang", timeout=30).json()["ranks"][0]["pid"]
    environ = dict(
        item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
    )
    assert {k: environ.get(k) for k in SAME_EVENT_LOOP_ENV} == SAME_EVENT_LOOP_ENV


@pytest.mark.unit
@pytest.mark.parametrize("share", [False, True], ids=["inline", "shm"])
def test_mask_and_causal_travel_on_the_channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, share: bool) -> None:
    """Issue 22: the key mask (always inline) and the causal flag reach rank 0's side intact."""
    if share and not shm.available():
        pytest.skip("needs a writable /dev/shm")
    seen: list[tuple] = []

    async def infer(x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    timeout_s: float | None = None) -> np.ndarray:
        seen.append((x.copy(), None if mask is None else mask.copy(), causal))
        return _affine(x)

    x = rand(3, 40, 512) if share else rand(2, 5, 8)
    mask = np.zeros(x.shape[:2], dtype=bool)
    mask[:, :3] = True

    async def body(_: ChannelServer, client: ChannelClient) -> None:
        out = await client.infer(x, share=share, mask=mask, causal=True)
        np.testing.assert_array_equal(out, _affine(x))
        out = await client.infer(x, share=share, causal=False)
        np.testing.assert_array_equal(out, _affine(x))

    _run_with_server(tmp_path, monkeypatch, body, infer=infer)
    (x1, m1, c1), (x2, m2, c2) = seen
    np.testing.assert_array_equal(x1, x)
    np.testing.assert_array_equal(m1, mask)
    assert c1 is True and m2 is None and c2 is False


@pytest.mark.unit
def test_deadline_travels_a_gone_client_cancels_and_a_drain_finishes_accepted_requests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 23: the request's seconds left reach the server's infer as `timeout_s`; a client
    that goes away mid-request cancels it there (counted); drain() stops new requests but
    answers the one already accepted."""
    seen: list[float | None] = []
    cancelled: list[bool] = []
    gate = asyncio.Event()

    async def infer(x: np.ndarray, mask=None, causal=None, timeout_s: float | None = None) -> np.ndarray:
        seen.append(timeout_s)
        try:
            if x.shape[0] == 3:  # the "slow" request
                await asyncio.sleep(30)
            if x.shape[0] == 4:  # the one accepted before the drain
                await gate.wait()
            return _affine(x)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def body(server: ChannelServer, client: ChannelClient) -> None:
        out = await client.infer(rand(1, 2, 8), timeout_s=2.5)
        assert np.array_equal(out, _affine(rand(1, 2, 8))) and 2.0 < seen[-1] <= 2.5
        gone = asyncio.ensure_future(client.infer(rand(3, 2, 8), timeout_s=10.0))
        await eventually_async(lambda: len(seen) == 2, 5, "the slow request reached the server's infer")
        gone.cancel()  # the client closes its connection
        await eventually_async(lambda: cancelled, 5, "the gone client's request cancelled on the server")
        assert server.stats()["disconnected"] == 1
        accepted = asyncio.ensure_future(client.infer(rand(4, 2, 8), timeout_s=10.0))
        await eventually_async(lambda: len(seen) == 3, 5, "the accepted request reached the server's infer")
        draining = asyncio.ensure_future(server.drain(timeout_s=10.0))
        await asyncio.sleep(0.1)  # by design: time in which a drain that did not wait would have ended
        assert not draining.done()  # it waits for the accepted request
        gate.set()
        assert np.array_equal(await accepted, _affine(rand(4, 2, 8)))
        assert await draining is True
        with pytest.raises(ChannelUnavailable):  # no new requests after the drain
            await client.infer(rand(1, 2, 8), timeout_s=1.0)

    _run_with_server(tmp_path, monkeypatch, body, infer=infer)


# -- where a request's time goes (service.metrics.timeline, issue 44) ---------------------

# The parts a request over the data channel is split into, in order, between the ingress's
# `decode` and its `return` (world size 2: the peers get a step header; gloo: all_reduce timed).
CHANNEL_PARTS = ["policy", "link_send", "gang_receive", "queue", "handoff", "header", "broadcast", "compute",
                 "all_reduce", "to_numpy", "to_loop", "reply", "link_receive"]


@pytest.mark.ray
def test_a_request_over_the_channel_names_every_part_of_its_time(app_url: str) -> None:
    """The link and the GangServer mark each part's end on the request's timeline (one host:
    one monotonic clock), so the parts follow one another and every mark falls inside the
    window this test measured around the call on its own clock (a stamp of rank 0's step
    clock moved wrongly onto the monotonic clock falls outside it, or out of order); the
    answer is still the reference's."""
    from service.metrics import timeline

    client = driver_side_policy(app_url)
    x = rand(3, 32, 512, seed=23)

    async def run() -> tuple[np.ndarray, Any, int]:
        marks = timeline.Timeline.starting_now()
        token = timeline.start(marks)
        try:
            out = np.array(await client.infer(x))
        finally:
            timeline.reset(token)
        returned_ns = time.monotonic_ns()
        marks.mark("return")
        return out, marks, returned_ns

    out, marks, returned_ns = asyncio.run(run())
    assert relative_error(torch.from_numpy(out), reference(x)) < 1e-5
    assert [name for name, _ in marks.marks] == [*CHANNEL_PARTS, "return"], marks.marks
    # Stamps from rank 0's wall-clock step clock are moved onto the monotonic clock (to ~1 us).
    slack_ns = 50_000
    stamps = [at for name, at in marks.marks if name != "return"]
    assert marks.start_ns <= stamps[0] and stamps[-1] <= returned_ns, (marks.start_ns, stamps, returned_ns)
    out_of_order = [(first, second) for (first, at), (second, next_at) in zip(marks.marks, marks.marks[1:])
                    if next_at < at - slack_ns]
    assert not out_of_order, (out_of_order, marks.marks)
    parts = dict(marks.parts_ms())
    assert parts["compute"] > 0 and parts["all_reduce"] > 0, parts


@pytest.mark.ray
def test_server_timing_names_where_the_time_went(app_url: str) -> None:
    """POST /infer's Server-Timing lists the ingress's parts (and, when the request took the
    data channel, the link's and the GangServer's) and their total. A body that arrives in two
    pieces `pause` apart spends that pause in `read`, which the total includes; the total fits
    inside what the client measured; the answer is the reference's."""
    pause = 0.5
    x = rand(2, 16, 512, seed=24)
    body = io_npy(x)

    def in_two_pieces() -> Iterator[bytes]:
        yield body[: len(body) // 2]
        time.sleep(pause)
        yield body[len(body) // 2:]

    for content in (in_two_pieces(), body):
        started = time.perf_counter()
        r = httpx.post(app_url + "/infer", content=content, headers={"content-type": "application/x-npy"}, timeout=60)
        client_ms = (time.perf_counter() - started) * 1000
        assert r.status_code == 200, r.text[:300]
        assert relative_error(torch.from_numpy(np.load(io.BytesIO(r.content))), reference(x)) < 1e-5
        entries = [part.strip().split(";dur=") for part in r.headers["server-timing"].split(",")]
        names, values = [name for name, _ in entries], [float(ms) for _, ms in entries]
        assert names[:2] == ["read", "decode"] and names[-2:] == ["encode", "total"], names
        assert names[2:-2] in (["gang"], [*CHANNEL_PARTS, "return"]), names
        assert all(v > -0.05 for v in values), entries
        read_ms, total_ms = values[0], values[-1]
        if content is not body:
            # The pause happened while the body was read (the route starts its clock a little
            # after the first piece left the client: the front door and Serve's routing).
            assert read_ms >= 0.6 * pause * 1000, entries
        assert read_ms <= total_ms <= client_ms, (entries, client_ms)


@pytest.mark.ray
def test_a_session_append_names_every_part_of_its_time(app_url: str) -> None:
    """POST /sessions/{id}/append's Server-Timing lists its parts as /infer's does (the body read
    and decoded as one part, `decode`), the step's `compute` among them over the data channel,
    and their total; an append whose body arrives in two pieces `pause` apart spends the pause
    in `decode`, which the total includes, and the total fits inside what the client measured."""
    pause = 0.5
    npy = {"content-type": "application/x-npy"}
    r = httpx.post(app_url + "/sessions", content=io_npy(rand(4, 512, seed=25)), headers=npy, timeout=60)
    assert r.status_code == 201, r.text[:300]
    sid = r.headers["x-session-id"]

    def in_two_pieces(body: bytes) -> Iterator[bytes]:
        yield body[: len(body) // 2]
        time.sleep(pause)
        yield body[len(body) // 2:]

    for i in range(3):
        body = io_npy(rand(1, 512, seed=26 + i))
        started = time.perf_counter()
        r = httpx.post(f"{app_url}/sessions/{sid}/append", content=in_two_pieces(body) if i == 0 else body,
                       headers=npy, timeout=60)
        client_ms = (time.perf_counter() - started) * 1000
        assert r.status_code == 200, r.text[:300]
        entries = [part.strip().split(";dur=") for part in r.headers["server-timing"].split(",")]
        names, values = [name for name, _ in entries], [float(ms) for _, ms in entries]
        assert names[0] == "decode" and names[-2:] == ["encode", "total"], names
        assert names[1:-2] in (["gang"], [*CHANNEL_PARTS, "return"]), names
        assert all(v > -0.05 for v in values), entries
        decode_ms, total_ms = values[0], values[-1]
        if i == 0:  # the pause happened while the body was read (the route's clock starts a little later)
            assert decode_ms >= 0.6 * pause * 1000, entries
        assert decode_ms <= total_ms <= client_ms, (entries, client_ms)
    httpx.delete(f"{app_url}/sessions/{sid}", timeout=60).raise_for_status()


def io_npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()
