"""The header link (service.gang.header_link) on real loopback sockets, without Ray: headers
arrive whole and in order (blocking and polling first), every wait is bounded, and each
failure says what was expected and what was found. The step loop over it, with the real
Rank in two processes, is tests/test_rank_worker.py's."""
from __future__ import annotations

import threading
import time

import pytest

from service.gang import control
from service.gang.header_link import HeaderListener, HeaderReceiver, HeaderSender

pytestmark = pytest.mark.unit


def _link(peers: int, timeout_s: float, on_cpu: tuple[bool, ...] | None = None
          ) -> tuple[HeaderSender, list[HeaderReceiver]]:
    """on_cpu: rank 0's and each peer's device (all CPU by default)."""
    on_cpu = on_cpu or (True,) * (peers + 1)
    listener = HeaderListener("127.0.0.1")
    receivers: dict[int, HeaderReceiver] = {}

    def connect(rank: int) -> None:
        receivers[rank] = HeaderReceiver("127.0.0.1", listener.port, rank, on_cpu[rank], timeout_s)

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(peers, 0, -1)]  # out of order
    for t in threads:
        t.start()
    sender = listener.accept(peers, 10.0, on_cpu[0])
    for t in threads:
        t.join(10.0)
    return sender, [receivers[r] for r in range(1, peers + 1)]


def test_every_peer_gets_every_header_in_order_blocking_or_polling_first() -> None:
    sender, receivers = _link(2, 5.0)
    buf = control.empty_header()
    try:
        for seq in range(1, 51):
            sender.send(control.loop_header(control.OP_HEARTBEAT, seq, seq * 10).encode())
        for rank, receiver in enumerate(receivers, start=1):
            for seq in range(1, 51):
                receiver.receive(buf, spin_ns=200_000 if seq % 2 else 0)
                h = control.Header.decode(buf)
                assert (h.op, h.seq, h.sent_ns) == (control.OP_HEARTBEAT, seq, seq * 10), (rank, h)
    finally:
        sender.close()
        for receiver in receivers:
            receiver.close()


def test_a_silent_rank_0_times_out_and_a_closed_one_ends_the_wait_at_once() -> None:
    sender, (receiver,) = _link(1, 0.3)
    buf = control.empty_header()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no header from rank 0 within the collective timeout 0.3s"):
        receiver.receive(buf)
    assert 0.3 - 0.05 <= time.monotonic() - t0 < 0.3 + 2.0
    sender.close()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="rank 0 closed the header link after 0 of the header.s 80 bytes"):
        receiver.receive(buf, spin_ns=100_000)
    assert time.monotonic() - t0 < 1.0
    receiver.close()


def test_rank_0_waits_for_its_peers_within_the_timeout_and_names_the_missing_ones() -> None:
    listener = HeaderListener("127.0.0.1")
    errors: list[BaseException] = []

    def join() -> None:  # waits for rank 0's answer, which never comes: its accept gave up
        try:
            HeaderReceiver("127.0.0.1", listener.port, 2, True, 5.0)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
            errors.append(exc)

    joiner = threading.Thread(target=join)
    joiner.start()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1, 3\] did not connect within 0.3s"):
        listener.accept(3, 0.3, True)
    assert time.monotonic() - t0 < 0.3 + 2.0
    joiner.join(10.0)
    assert len(errors) == 1 and isinstance(errors[0], ConnectionError), errors


def test_the_link_carries_inputs_only_when_every_rank_is_on_cpu() -> None:
    for devices, expected in (((True, True, True), True), ((True, False, True), False), ((False, True, True), False)):
        sender, receivers = _link(2, 5.0, devices)
        try:
            assert [sender.carries_data] + [r.carries_data for r in receivers] == [expected] * 3, devices
        finally:
            sender.close()
            for receiver in receivers:
                receiver.close()


def test_a_header_of_the_wrong_size_is_refused_before_it_is_sent() -> None:
    sender, (receiver,) = _link(1, 5.0)
    try:
        with pytest.raises(ValueError, match=r"a header is 80 bytes \(10 int64\); got 72"):
            sender.send(control.empty_header()[:9])
    finally:
        sender.close()
        receiver.close()


def test_a_steps_data_follows_its_header_exactly() -> None:
    """A header, then a step's input and an int64 plan on the same stream (a step's order)."""
    import torch

    sender, receivers = _link(2, 5.0)
    x = torch.randn(1, 8, 512)
    plan = torch.arange(37, dtype=torch.int64)
    try:
        sender.send(control.loop_header(control.OP_HEARTBEAT, 1, 0).encode())
        sender.send_tensor(plan)
        sender.send_tensor(x.reshape(-1))
        for receiver in receivers:
            buf, got_plan, got_x = control.empty_header(), torch.empty(37, dtype=torch.int64), torch.empty(8 * 512)
            receiver.receive(buf)
            receiver.receive_tensor(got_plan, what="step's plan")
            receiver.receive_tensor(got_x, spin_ns=100_000)
            assert control.Header.decode(buf).seq == 1
            assert torch.equal(got_plan, plan) and torch.equal(got_x, x.reshape(-1))
    finally:
        sender.close()
        for receiver in receivers:
            receiver.close()
