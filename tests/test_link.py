"""The ingress -> rank 0 link (service.transport.link.GangLink), on its own: the route it
takes for each gang status, its fallbacks and its counters (GET /gang `ingress_transport`).

Real parts throughout: a real ChannelServer and ChannelClient over a real Unix socket, real
shared memory in /dev/shm (the channel's region and the handle path's files). What stands
in for the GangServer replica is `_Rank0`, a small in-process object with the replica's
handle methods (`infer`, `infer_shared`, `session_append`) computing y = 2x + 1; every
expected output below is computed here with numpy, not by the code under test.
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.contract.gang_status import AnyGangStatus, DataChannelStatus, GangStatus, SynthesizedStatus
from service.transport import channel, shm
from service.transport.channel import ChannelServer
from service.transport.link import GangLink
from service.config.tunables import TransportTunables
from tests.helpers import rand
from tests.statuses import gang_report

pytestmark = pytest.mark.unit

HERE = "node0"  # the link's node; rank 0 runs there unless a test says otherwise
TUNABLES = TransportTunables(min_shared_bytes=4096)  # 1024 float32 values and up go through shared memory


def expected(x: np.ndarray) -> np.ndarray:
    return 2.0 * x.astype(np.float32) + 1.0


def _compute(x: np.ndarray) -> np.ndarray:
    """The stand-in gang's function (y = 2x + 1, float32)."""
    return (x * np.float32(2.0) + np.float32(1.0)).astype(np.float32)


class _Rank0:
    """The GangServer replica's handle methods, in process (service.transport.link.GangCalls)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.keys: list[str | None] = []  # the idempotency keys of its session appends

    async def call(self, method: str, *args: Any, deadline: float, **kwargs: Any) -> Any:
        self.calls.append(method)
        assert deadline > time.monotonic(), "a request was sent past its deadline"
        if method == "infer":
            x, _mask, _causal = args
            return _compute(x)
        if method == "infer_shared":
            ref, _mask, _causal = args
            view = shm.open_ref(ref, HERE)  # as the replica does: read the pages, write the reply into them
            view[...] = _compute(view)
            return view.shape
        if method == "session_append":
            x, length = args
            self.keys.append(kwargs["idempotency_key"])
            return _compute(x), {"session_id": kwargs["session_id"], "length": (length or 0) + len(x)}
        raise AssertionError(f"unexpected call {method}")


def _status(listening: bool = True, rank0_node: str = HERE, replica_id: str = "replica1", state: str = "ready",
            generation: int = 1) -> GangStatus:
    ranks = [{"rank": r, "node_id": rank0_node if r == 0 else "node1", "node_ip": "10.0.0.1", "pid": 100 + r,
              "device": "cpu", "iface": None} for r in range(2)]
    return gang_report(state=state, replica_id=replica_id, ranks=ranks, generation=generation,
                       data_channel=DataChannelStatus(listening=listening, requests=0, refused_overloaded=0,
                                                      disconnected=0, in_flight=0))


def _observe(link: GangLink, status: AnyGangStatus, fleet_rank0_nodes: frozenset[str] | None = frozenset()) -> None:
    """`link.observe` as the status view calls it: with one gang no other nodes (given: as with
    several gangs, the fleet view's rank-0 nodes, None when it is not current)."""
    link.observe(status, fleet_rank0_nodes)


def _link(rank0: _Rank0, channel_enabled: bool = True, shm_enabled: bool = True) -> GangLink:
    return GangLink(node_id=HERE, channel_enabled=channel_enabled, shm_enabled=shm_enabled, calls=rank0,
                    tunables=TUNABLES)


async def _serve_channel(replica_id: str = "replica1", keys: list[str | None] | None = None) -> ChannelServer:
    """A channel server computing y = 2x + 1; its session appends' keys are appended to `keys`."""
    async def infer(x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                    timeout_s: float | None = None) -> np.ndarray:
        return _compute(x)

    async def append(x: np.ndarray, length: int | None, timeout_s: float | None = None,
                     session_id: str = "", idempotency_key: str | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        if keys is not None:
            keys.append(idempotency_key)
        return _compute(x), {"session_id": session_id, "length": (length or 0) + len(x)}

    server = ChannelServer(infer, max_in_flight=4, session_append=append, tunables=TUNABLES)
    assert await server.start(replica_id)
    return server


def _counts(link: GangLink) -> dict[str, int]:
    t = link.transport()
    return {"data_channel": t.data_channel, "data_channel_fallbacks": t.data_channel_fallbacks,
            "shared_memory": t.shared_memory, "shared_memory_fallbacks": t.shared_memory_fallbacks,
            "object_store": t.object_store}


@pytest.fixture(autouse=True)
def _sockets_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel, "SOCKET_DIR", tmp_path)


def _shm_files() -> set[str]:
    return {p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}*")} if shm.SHM_DIR.is_dir() else set()


def _request_frames(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, int]]:
    """What crosses the socket towards the server: (the shared region's name or None, payload
    bytes) of each request frame the server reads (the real read_frame runs; replies, which
    carry no `op`, are not recorded)."""
    frames: list[tuple[str | None, int]] = []
    read_frame = channel.read_frame

    async def recording(reader: asyncio.StreamReader, max_header_bytes: int) -> tuple[dict[str, Any], bytes]:
        header, payload = await read_frame(reader, max_header_bytes)
        if "op" in header:
            frames.append((header.get("shm"), len(payload)))
        return header, payload

    monkeypatch.setattr(channel, "read_frame", recording)
    return frames


def test_a_ready_gang_with_rank_0_here_is_served_over_the_channel_inline_and_shared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The small tensor's bytes cross the socket; the big one's do not: its frame names a
    region in /dev/shm, the server reads the input from it and writes the output into it."""
    small, big = rand(1, 4, 8, seed=1), rand(2, 16, 64, seed=2)  # 128 B inline; 8 KiB through the region
    rank0 = _Rank0()
    frames = _request_frames(monkeypatch)
    before = _shm_files()

    async def main() -> list[np.ndarray]:
        server = await _serve_channel()
        link = _link(rank0)
        try:
            _observe(link, _status())
            deadline = time.monotonic() + 10
            return [await link.infer(small, None, None, deadline), await link.infer(big, None, None, deadline)]
        finally:
            link.close()
            server.close()

    out_small, out_big = asyncio.run(main())
    np.testing.assert_array_equal(out_small, expected(small))
    np.testing.assert_array_equal(out_big, expected(big))
    assert rank0.calls == []  # nothing took the handle
    assert len(frames) == 2, frames
    (small_region, small_bytes), (big_region, big_bytes) = frames
    assert (small_region, small_bytes) == (None, small.nbytes), frames  # inline: the tensor itself
    assert big_region is not None and big_region.startswith(shm.PREFIX) and big_bytes == 0, frames
    # The region went with the connection, and no other of this process's is left (the Ray
    # tests' processes beside this run make and drop regions of their own meanwhile).
    left = _shm_files()
    ours = {name for name in left - before if name.startswith(f"{shm.PREFIX}{os.getpid()}-")}
    assert big_region not in left and not ours, ours


def test_a_channel_that_went_down_falls_back_to_the_handle_and_is_not_retried_at_once() -> None:
    x = rand(1, 4, 8, seed=3)
    rank0 = _Rank0()

    async def main() -> tuple[list[np.ndarray], dict[str, int], float]:
        server = await _serve_channel()
        link = _link(rank0)
        try:
            _observe(link, _status())
            deadline = time.monotonic() + 10
            first = await link.infer(x, None, None, deadline)  # over the channel
            await server.drain(1.0)  # the gang server goes away: its connections close unanswered
            before = time.monotonic()
            outs = [first, await link.infer(x, None, None, deadline), await link.infer(x, None, None, deadline)]
            assert link.route_lost_at >= before  # the request policy reads it: look at the gang again
            return outs, _counts(link), link.route_lost_at
        finally:
            link.close()

    outs, counts, _ = asyncio.run(main())
    for out in outs:
        np.testing.assert_array_equal(out, expected(x))
    # One channel attempt failed (counted as sent and as a fallback); then the handle, twice,
    # without trying the channel again within channel_retry_after_s.
    assert counts == {"data_channel": 2, "data_channel_fallbacks": 1, "shared_memory": 0,
                      "shared_memory_fallbacks": 0, "object_store": 2}, counts
    assert rank0.calls == ["infer", "infer"]


@pytest.mark.parametrize("status", [
    _status(listening=False),  # the gang server has no socket
    _status(rank0_node="node1"),  # rank 0 runs on another node
    _status(state="rebuilding"),  # not ready: its socket may belong to a gang that is going
], ids=["not-listening", "rank0-elsewhere", "rebuilding"])
def test_without_a_usable_channel_requests_take_the_handle(status: GangStatus) -> None:
    x = rand(1, 4, 8, seed=4)
    rank0 = _Rank0()

    async def main() -> np.ndarray:
        server = await _serve_channel()  # listening, but not the route for this status
        link = _link(rank0)
        try:
            _observe(link, status)
            return await link.infer(x, None, None, time.monotonic() + 10)
        finally:
            link.close()
            server.close()

    np.testing.assert_array_equal(asyncio.run(main()), expected(x))
    assert rank0.calls == ["infer"]


@pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")
def test_the_handle_path_hands_big_tensors_over_shared_memory_and_leaves_no_file() -> None:
    big, small = rand(2, 16, 64, seed=5), rand(1, 2, 8, seed=6)
    rank0 = _Rank0()
    before = _shm_files()

    async def main() -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        link = _link(rank0, channel_enabled=False)
        _observe(link, _status())
        deadline = time.monotonic() + 10
        return await link.infer(big, None, None, deadline), await link.infer(small, None, None, deadline), _counts(link)

    out_big, out_small, counts = asyncio.run(main())
    np.testing.assert_array_equal(out_big, expected(big))
    np.testing.assert_array_equal(out_small, expected(small))
    assert rank0.calls == ["infer_shared", "infer"]  # the small one is not worth a file
    assert counts["shared_memory"] == 1 and counts["object_store"] == 1 and counts["data_channel"] == 0, counts
    assert _shm_files() <= before


@pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")
def test_with_several_gangs_shared_memory_only_when_every_gangs_rank_0_is_on_this_node() -> None:
    """Several gangs: Serve's router picks the gang of a handle call, so a big tensor goes
    through /dev/shm only when rank 0 of every gang is on this node; one gang elsewhere, or a
    fleet view not current (None), and it goes by value, never a hand-off that fails there."""
    big = rand(2, 16, 64, seed=11)
    rank0 = _Rank0()

    async def main() -> list[dict[str, int]]:
        link = _link(rank0, channel_enabled=False)  # several gangs: no data channel
        counts = []
        for nodes in (frozenset({HERE, "node9"}), None, frozenset({HERE})):
            _observe(link, _status(), nodes)
            np.testing.assert_array_equal(await link.infer(big, None, None, time.monotonic() + 10), expected(big))
            counts.append(_counts(link))
        return counts

    elsewhere, unknown, all_here = asyncio.run(main())
    assert rank0.calls == ["infer", "infer", "infer_shared"], rank0.calls
    assert (elsewhere["object_store"], unknown["object_store"], all_here["shared_memory"]) == (1, 2, 1)
    assert all_here["shared_memory_fallbacks"] == 0


def test_a_failed_shared_memory_hand_off_sends_tensors_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "SHM_DIR", Path("/nonexistent-shm-dir"))  # as if /dev/shm were gone or full
    big = rand(2, 16, 64, seed=7)
    rank0 = _Rank0()

    async def main() -> tuple[list[np.ndarray], dict[str, int]]:
        link = _link(rank0, channel_enabled=False)
        _observe(link, _status())
        deadline = time.monotonic() + 10
        return [await link.infer(big, None, None, deadline), await link.infer(big, None, None, deadline)], _counts(link)

    outs, counts = asyncio.run(main())
    for out in outs:
        np.testing.assert_array_equal(out, expected(big))
    # One failed hand-off, then by value without trying shared memory again for a while.
    assert counts["shared_memory_fallbacks"] == 1 and counts["object_store"] == 2 and counts["shared_memory"] == 0
    assert rank0.calls == ["infer", "infer"]


def test_a_gang_that_cannot_answer_drops_the_channel_and_a_new_replica_gets_its_own() -> None:
    """No gang server answers (a synthesized status): the channel is dropped; the next ready
    status names another replica: the link connects to that replica's socket."""
    x = rand(1, 4, 8, seed=8)
    rank0 = _Rank0()

    async def main() -> dict[str, int]:
        first, second = await _serve_channel("replica1"), await _serve_channel("replica2")
        link = _link(rank0)
        try:
            deadline = time.monotonic() + 10
            _observe(link, _status(replica_id="replica1"))
            np.testing.assert_array_equal(await link.infer(x, None, None, deadline), expected(x))
            _observe(link, SynthesizedStatus(state="scheduling", code="gang_scheduling", reason="waiting for CPUs"))
            np.testing.assert_array_equal(await link.infer(x, None, None, deadline), expected(x))  # the handle
            await first.drain(1.0)  # the old replica is gone; the new one listens
            _observe(link, _status(replica_id="replica2", generation=1))
            np.testing.assert_array_equal(await link.infer(x, None, None, deadline), expected(x))
            assert second.requests == 1 and first.requests == 1
            return _counts(link)
        finally:
            link.close()
            first.close()
            second.close()

    counts = asyncio.run(main())
    assert counts["data_channel"] == 2 and counts["data_channel_fallbacks"] == 0 and counts["object_store"] == 1
    assert rank0.calls == ["infer"]


def test_session_appends_take_the_channel_then_the_handle_when_it_fails() -> None:
    """Each route carries the append's idempotency key unchanged (what makes the fallback safe)."""
    rows = rand(1, 5, 8, seed=9)[0]  # [5, E]
    rank0 = _Rank0()
    channel_keys: list[str | None] = []

    async def main() -> list[tuple[np.ndarray, dict[str, Any]]]:
        server = await _serve_channel(keys=channel_keys)
        link = _link(rank0)
        try:
            _observe(link, _status())
            deadline = time.monotonic() + 10
            first = await link.session_append(rows[:3], 0, session_id="s-1", idempotency_key="key-1",
                                              deadline=deadline)
            await server.drain(1.0)
            second = await link.session_append(rows[3:], 3, session_id="s-1", idempotency_key="key-2",
                                               deadline=deadline)
            return [first, second]
        finally:
            link.close()

    (out1, info1), (out2, info2) = asyncio.run(main())
    np.testing.assert_array_equal(out1, expected(rows[:3]))
    np.testing.assert_array_equal(out2, expected(rows[3:]))
    assert (info1["length"], info2["length"]) == (3, 5)
    assert rank0.calls == ["session_append"]  # only the second, after the channel failed
    assert channel_keys == ["key-1"] and rank0.keys == ["key-2"]
