"""The real rank class (service.gang.worker.Rank) in two processes on gloo, without Ray.

Rank 0 and rank 1 are spawned with torch.multiprocessing and run exactly what the gang
runs: rank 0 hosts the store, both rendezvous, load the seed weights, rank 1 starts its
step loop and rank 0 drives steps with headers and `Forward.root` (service.gang.steps). Checked against the
independent dense reference (nn.MultiheadAttention with the same weights), then: a peer
killed in the middle of a step gives rank 0 an error at once, a peer that stops gives a
timeout error within the group timeout, teardown is bounded, and a second gang forms in
the same rank-0 process. The peer polls for its headers before it sleeps (a tunable).
"""
from __future__ import annotations

from pathlib import Path

import os
import queue
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tests.reference import dense_attention_masked, notes_seed_weights, relative_error

pytestmark = pytest.mark.unit

E, H = 64, 4
KILL_TIMEOUT_S = 20.0  # generation 1: a dead peer must be noticed long before this
STOP_TIMEOUT_S = 5.0  # generation 2: a stopped peer is noticed by the group timeout
CASES = {"plain": (False, False), "masked": (True, False), "causal": (False, True), "masked+causal": (True, True)}


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(3)
    x = gen.standard_normal((2, 6, E)).astype(np.float32)
    mask = np.ones((2, 6), dtype=np.bool_)
    mask[1, :2] = False  # left padding: with causal, padded query 0 has no key
    return x, mask


def _step(rank: Any, seq: int, x: np.ndarray, mask: np.ndarray | None, causal: bool,
          between: Any = None) -> np.ndarray:
    """What the gang's sequencer does for one step with the step loop on; `between()` runs
    after the header went out, before rank 0's own collectives."""
    from service.gang.steps import Forward

    step = Forward(x, mask, causal)
    rank.send_header(step.kind.header(seq, rank.dtype, 1, time.time_ns(), step.fields()))
    rank.step_seq = seq
    if between is not None:
        between()
    return step.root(rank, 1)


def _peer_main(port: int, timeout_s: float, up: Any) -> None:
    from service.config.tunables import GangTunables
    from service.gang.worker import PlainModel, Rank

    # The peer polls for each header before it sleeps (tunables.gang.header_spin_us_cpu; 0, the
    # CPU default, is the Ray tests' path): its steps and its failures must be the same.
    rank = Rank(1, 2, device=torch.device("cpu"), node_ip="127.0.0.1",
                tunables=GangTunables(header_spin_us_cpu=200.0))
    up.put("up")  # its interpreter and torch are loaded: rank 0 may begin its timed rendezvous
    rank.rendezvous("127.0.0.1", port, "gloo", timeout_s)
    rank.load_weights(PlainModel(embed_dim=E, num_heads=H, init="seed"), 1)
    rank.start_loop()
    assert rank._loop is not None
    rank._loop.join()  # a failed loop exits this process itself (tunables.gang.peer_exit_grace_s)


def _root_main(out: Any, cmd: Any) -> None:
    from service.gang.worker import PlainModel, Rank

    x, mask = _inputs()
    for gen, timeout_s in ((1, KILL_TIMEOUT_S), (2, STOP_TIMEOUT_S)):
        rank = Rank(0, 2, device=torch.device("cpu"), node_ip="127.0.0.1")
        out.put(("port", gen, rank.open_store(timeout_s)))
        # As a gang's rank actors are up before rank 0 waits for them: the peer's process start
        # (seconds under `make test`'s load) is not part of the group timeout it is given.
        told = cmd.get(timeout=120)
        if told != "rendezvous":
            raise RuntimeError(f"rank 0 expected 'rendezvous', was told {told!r}")
        rank.rendezvous("127.0.0.1", 0, "gloo", timeout_s)
        rank.load_weights(PlainModel(embed_dim=E, num_heads=H, init="seed"), 1)
        seq = 0
        for name, (masked, causal) in CASES.items():
            seq += 1
            out.put(("out", gen, name, _step(rank, seq, x, mask if masked else None, causal)))
        out.put(("timings", gen, rank.last_bcast_ns, rank.last_forward_ns))
        out.put(("drill", gen))
        assert cmd.get(timeout=60) == "go"
        started = time.monotonic()
        try:
            _step(rank, seq + 1, x, mask, False, between=lambda: out.put(("in-step", gen)))
            out.put(("error", gen, time.monotonic() - started, "no error: the step completed"))
        except Exception as exc:  # what the gang would turn into 503/504
            out.put(("error", gen, time.monotonic() - started, f"{type(exc).__name__}: {exc}"))
        started = time.monotonic()
        rank.close()
        out.put(("closed", gen, time.monotonic() - started))


def _wait_idle(pid: int, timeout_s: float = 30.0) -> None:
    """Until every thread of `pid` sleeps (state S) on 3 reads 20 ms apart: the peer has
    finished its step and waits in the next header's receive. Stopping it before that (a
    loaded machine) would leave rank 0's header send unreceived, and the step would time out
    in the header instead of in its collectives."""
    deadline, quiet = time.monotonic() + timeout_s, 0
    while quiet < 3:
        states = _thread_states(pid)
        assert states, f"peer {pid} is gone"
        quiet = quiet + 1 if all(state == "S" for state in states) else 0
        assert time.monotonic() < deadline, f"peer {pid} not idle within {timeout_s:g}s: {states}"
        time.sleep(0.02)


def _thread_states(pid: int) -> list[str]:
    """Each thread's state letter from /proc (S: sleeping, R: running, T: stopped); a thread
    that exits while read is left out, none when the process is gone."""
    states = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return states
    for task in tasks:
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue  # a thread that just exited
    return states


def _expect(out: Any, kind: str, timeout_s: float = 120.0) -> tuple:
    msg = out.get(timeout=timeout_s)
    assert msg[0] == kind, f"expected {kind!r} from rank 0, got {msg[:3]!r}"
    return msg


def test_two_real_ranks_match_dense_and_fail_bounded_when_a_peer_dies_or_stops() -> None:
    ctx = mp.get_context("spawn")
    out, cmd = ctx.Queue(), ctx.Queue()
    root = ctx.Process(target=_root_main, args=(out, cmd), daemon=True)
    root.start()
    peers: list[Any] = []
    x, mask = _inputs()
    weights = notes_seed_weights(E)
    try:
        for gen, timeout_s in ((1, KILL_TIMEOUT_S), (2, STOP_TIMEOUT_S)):
            port = _expect(out, "port")[2]
            up = ctx.Queue()
            peer = ctx.Process(target=_peer_main, args=(port, timeout_s, up), daemon=True)
            peer.start()
            peers.append(peer)
            assert up.get(timeout=120) == "up"
            cmd.put("rendezvous")
            for name, (masked, causal) in CASES.items():
                got = _expect(out, "out")
                assert got[1:3] == (gen, name)
                want = dense_attention_masked(weights, H, torch.from_numpy(x),
                                              torch.from_numpy(mask).int() if masked else None, causal)
                err = relative_error(torch.from_numpy(got[3]), want)
                assert err < 1e-5, f"generation {gen}, {name}: relative error {err:.3e} vs dense MHA"
                if masked:
                    assert (got[3][~mask] == 0).all(), "padded query positions must be exactly 0"
            _, _, bcast_ns, forward_ns = _expect(out, "timings")
            assert 0 < bcast_ns <= forward_ns
            _expect(out, "drill")
            _wait_idle(peer.pid)  # waiting for the next header ...
            os.kill(peer.pid, signal.SIGSTOP)  # ... and then taking no part in the step
            cmd.put("go")
            _expect(out, "in-step")  # rank 0's header is out; its collectives follow at once
            if gen == 1:
                os.kill(peer.pid, signal.SIGKILL)  # dies in the middle of the step
                _, _, elapsed, why = _expect(out, "error")
                assert why.startswith(("RuntimeError", "DistBackendError", "DistNetworkError")), why
                assert elapsed < KILL_TIMEOUT_S / 2, f"a dead peer took {elapsed:.1f}s to notice: {why}"
            else:  # stays stopped: a peer that never returns
                _, _, elapsed, why = _expect(out, "error")
                # Once (2026-12-07, under make test's load) the step completed here; not reproduced
                # since (15 runs beside two busy loops): the peer's state says more if it recurs.
                assert "timed out" in why.lower() or "timeout" in why.lower(), (
                    f"{why} after {elapsed:.2f}s; the peer's threads then: {''.join(_thread_states(peer.pid)) or 'none'}")
                assert STOP_TIMEOUT_S * 0.8 < elapsed < STOP_TIMEOUT_S * 3, f"{elapsed:.1f}s: {why}"
            closed_s = _expect(out, "closed")[2]
            assert closed_s < 5.0, f"teardown took {closed_s:.1f}s"
    finally:
        for proc in (*peers, root):
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)
        try:
            while True:
                out.get_nowait()
        except queue.Empty:
            pass


def test_a_world_size_1_step_takes_the_shortest_path_and_names_its_parts() -> None:
    """World size 1 through the step runner (service.gang.runner): no header, no broadcast, no
    step clock, and still the dense answer in every case; its timeline has the step's parts
    (the input as a tensor, compute, to_numpy), each a duration of its own, ending in order;
    a step expecting another weights version is refused (no answer from stale weights)."""
    from service.config.builder_args import GangConfig
    from service.config.tunables import GangTunables
    from service.contract.gang_status import GangState
    from service.contract.timing import Part
    from service.gang.runner import Health, Members, StepRunner
    from service.gang.steps import Forward
    from service.gang.worker import PlainModel, Rank
    from service.metrics.timeline import Timeline

    rank = Rank(0, 1, device=torch.device("cpu"), node_ip="127.0.0.1")
    rank.rendezvous("127.0.0.1", 0, "gloo", 5.0)
    rank.load_weights(PlainModel(embed_dim=E, num_heads=H, init="seed"), 1)
    health = Health()
    health.set(GangState.READY, "ready")
    seen: list[Timeline] = []
    runner = StepRunner(health, Members(root=rank), GangConfig(world_size=1), GangTunables(), on_parts=seen.append)
    x, mask = _inputs()
    weights = notes_seed_weights(E)
    try:
        for name, (masked, causal) in CASES.items():
            marks = Timeline.starting_now()
            got = runner.run_step(Forward(x, mask if masked else None, causal), 1, marks)
            want = dense_attention_masked(weights, H, torch.from_numpy(x),
                                          torch.from_numpy(mask).int() if masked else None, causal)
            assert relative_error(torch.from_numpy(got), want) < 1e-5, name
            assert [part for part, _ in marks.marks] == [Part.BROADCAST, Part.COMPUTE, Part.TO_NUMPY], marks.marks
            ends = [marks.start_ns, *(at for _, at in marks.marks)]
            assert ends == sorted(ends), marks.marks
            assert seen[-1] is marks  # the metrics are told of the same timeline
        assert rank._clock is None  # no step clock was made
        with pytest.raises(Exception, match="weights"):
            runner.run_step(Forward(x), 2)
        assert health.state is GangState.BROKEN
    finally:
        runner.shutdown()
        rank.close()
