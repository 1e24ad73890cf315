"""The gang's step path, measured without Ray or Serve (bench/NOTES.md records the results):

- `ws1`: one step at world size 1 through the step runner (service.gang.runner.StepRunner.run_step:
  the step kind's rank-0 side, the parts marked on a timeline, the metrics observer), on the
  calling thread, at [1, 8, 512] and [128, 8, 512], 2 torch threads. Run it once per source
  tree (PYTHONPATH) to compare two versions of the path side by side;
- `header`: a peer's wait for rank 0's next header (two gloo processes on loopback, the real
  Rank's send_header / wait_header): rank 0 sends a header every `gap_ms`, the peer answers
  with a one-value broadcast at once; per spin (tunables.gang.header_spin_us_cpu): the medians
  of rank 0's send call, of the one-way time from rank 0's send to the peer holding the header
  (both processes read the same CLOCK_MONOTONIC), and of the round trip, and the peer's CPU
  seconds per wall second (the spin's cost). Run it once per source tree (PYTHONPATH) to
  compare two header transports;
- `ws2`: one whole step at world size 2 as rank 0's sequencer runs it (the header, then the
  step kind's rank-0 side: the data broadcast, its half of the compute, the all_reduce) with the
  real peer's step loop in a second process (gloo on loopback, 1 torch thread per rank), one
  step every `gap_ms` so the peer sleeps between steps as a served gang's does; the medians of
  the step and of its header send. Run it once per source tree (PYTHONPATH);
- `sequencer`: the event loop's hand-off of one step to the sequencer thread and back
  (service.gang.sequencer.Sequencer.run with a step timeout and a request deadline, as a served
  step has), this tree's against `rev`'s (default HEAD, read with `git show`), interleaved in one
  process and one loop: the median round trip of a no-op step and of a 1 ms step that releases
  the GIL (time.sleep, as a collective's wait does), and the loop's cross-thread wakes per step
  (call_soon_threadsafe calls counted).

    PYTHONPATH=<tree> python bench/step_levers.py ws1 [rounds]
    python bench/step_levers.py header [spins_us, comma-separated] [gap_ms]
    PYTHONPATH=<tree> python bench/step_levers.py ws2 [gap_ms] [steps] [cpu|cuda (both ranks on cuda:0, gloo)]
    python bench/step_levers.py sequencer [rev] [rounds]
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch


def ws1(rounds: int = 7, calls: int = 200) -> None:
    from service.config.builder_args import GangConfig
    from service.config.tunables import GangTunables
    from service.contract.gang_status import GangState
    from service.gang.runner import Health, Members, StepRunner
    from service.gang.steps import Forward
    from service.gang.worker import PlainModel, Rank
    from service.metrics.timeline import Timeline

    torch.set_num_threads(2)
    rank = Rank(0, 1, device=torch.device("cpu"), node_ip="127.0.0.1", torch_threads=2)
    rank.rendezvous("127.0.0.1", 0, "gloo", 10.0)
    rank.load_weights(PlainModel(embed_dim=512, num_heads=8), 1)
    health = Health()
    health.set(GangState.READY, "ready")
    parts: list[Timeline] = []
    runner = StepRunner(health, Members(root=rank), GangConfig(world_size=1), GangTunables(), on_parts=parts.append)
    for shape in ((1, 8, 512), (128, 8, 512)):
        x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        n = calls if shape[0] == 1 else max(10, calls // 20)
        step = Forward(x)
        for _ in range(10):
            runner.run_step(step, 1, Timeline.starting_now())
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                runner.run_step(step, 1, Timeline.starting_now())
            samples.append((time.perf_counter() - t0) / n * 1e6)
        compute = statistics.median(
            sum(ms for part, ms in t.parts_ms() if part.value in ("broadcast", "compute")) for t in parts[-n:])
        print(f"ws1 run_step {list(shape)}: median {statistics.median(samples):.1f} us per step "
              f"(rounds {', '.join(f'{s:.0f}' for s in samples)}); its compute parts {compute * 1000:.1f} us")
        parts.clear()
    runner.shutdown()


def _header_peer(port: int, spin_us: float, gap_ms: float, steps: int, out: "object") -> None:
    import torch.distributed as dist

    from service.config.tunables import GangTunables
    from service.gang.worker import Rank

    rank = Rank(1, 2, device=torch.device("cpu"), node_ip="127.0.0.1", tunables=GangTunables(header_spin_us_cpu=spin_us))
    rank.rendezvous("127.0.0.1", port, "gloo", 30.0)
    reply = torch.zeros(1, dtype=torch.int64)
    held: list[int] = []
    cpu0, wall0 = time.process_time(), time.monotonic()
    for _ in range(steps):
        rank.wait_header()
        held.append(time.perf_counter_ns())
        dist.broadcast(reply, src=1)
    out.put(((time.process_time() - cpu0) / (time.monotonic() - wall0), held))  # type: ignore[attr-defined]
    rank.close()


def header(spins_us: list[float], gap_ms: float = 2.0, steps: int = 400) -> None:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from service.gang import control
    from service.gang.worker import Rank

    ctx = mp.get_context("spawn")
    for spin_us in spins_us:
        out = ctx.Queue()
        root = Rank(0, 2, device=torch.device("cpu"), node_ip="127.0.0.1")
        port = root.open_store(30.0)
        peer = ctx.Process(target=_header_peer, args=(port, spin_us, gap_ms, steps, out), daemon=True)
        peer.start()
        root.rendezvous("127.0.0.1", port, "gloo", 30.0)
        reply = torch.zeros(1, dtype=torch.int64)
        rtt, send, sent = [], [], []
        for seq in range(1, steps + 1):
            time.sleep(gap_ms / 1000)  # between steps: the peer waits (and may spin) for the header
            t0 = time.perf_counter_ns()
            root.send_header(control.loop_header(control.OP_HEARTBEAT, seq, 0))
            send.append((time.perf_counter_ns() - t0) / 1000)
            dist.broadcast(reply, src=1)
            rtt.append((time.perf_counter_ns() - t0) / 1000)
            sent.append(t0)
        cpu, held = out.get(timeout=60)
        peer.join(30)
        root.close()
        one_way = statistics.median((h - t) / 1000 for t, h in zip(sent, held))
        print(f"header wait, spin {spin_us:g} us, gap {gap_ms:g} ms: rank 0's send {statistics.median(send):.1f} us, "
              f"send -> the peer holds it {one_way:.1f} us, round trip median {statistics.median(rtt):.1f} us, "
              f"p90 {statistics.quantiles(rtt, n=10)[-1]:.1f} us; the peer's CPU {cpu:.2f} s per s; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)


def _ws2_peer(port: int, device: str) -> None:
    from service.gang.worker import PlainModel, Rank

    rank = Rank(1, 2, device=torch.device(device), node_ip="127.0.0.1", torch_threads=1)
    rank.rendezvous("127.0.0.1", port, "gloo", 30.0)
    rank.load_weights(PlainModel(embed_dim=512, num_heads=8), 1)
    rank.start_loop()
    assert rank._loop is not None
    rank._loop.join()  # until rank 0's OP_STOP
    rank.close()


def ws2(gap_ms: float = 2.0, steps: int = 400, device: str = "cpu") -> None:
    import torch.multiprocessing as mp

    from service.gang import control
    from service.gang.steps import Forward
    from service.gang.worker import PlainModel, Rank

    ctx = mp.get_context("spawn")
    root = Rank(0, 2, device=torch.device(device), node_ip="127.0.0.1", torch_threads=1)
    port = root.open_store(30.0)
    peer = ctx.Process(target=_ws2_peer, args=(port, device), daemon=True)
    peer.start()
    root.rendezvous("127.0.0.1", port, "gloo", 30.0)
    root.load_weights(PlainModel(embed_dim=512, num_heads=8), 1)
    x = np.random.default_rng(0).standard_normal((1, 8, 512), dtype=np.float32)
    step = Forward(x)
    whole, header = [], []
    for seq in range(1, steps + 1):
        time.sleep(gap_ms / 1000)  # the peer goes back to sleep in its header wait
        t0 = time.perf_counter_ns()
        root.send_header(step.kind.header(seq, root.dtype, 1, time.time_ns(), step.fields()))
        t1 = time.perf_counter_ns()
        root.step_seq = seq
        step.root(root, 1)
        whole.append((time.perf_counter_ns() - t0) / 1000)
        header.append((t1 - t0) / 1000)
    root.send_header(control.loop_header(control.OP_STOP, steps + 1, time.time_ns()))
    peer.join(30)
    root.close()
    kept = whole[steps // 10:]  # the first steps warm the allocator and the connections
    print(f"ws2 step [1, 8, 512] on {device} (gloo), gap {gap_ms:g} ms: median {statistics.median(kept):.1f} us "
          f"(p25 {statistics.quantiles(kept, n=4)[0]:.0f}, p75 {statistics.quantiles(kept, n=4)[2]:.0f}), "
          f"its header send {statistics.median(header[steps // 10:]):.1f} us; load {os.getloadavg()[0]:.1f}",
          flush=True)


def sequencer(rev: str = "HEAD", rounds: int = 9, calls: int = 300) -> None:
    import asyncio
    import importlib.util
    import random
    import tempfile

    from service.gang import sequencer as now

    source = subprocess.run(["git", "show", f"{rev}:service/gang/sequencer.py"], check=True,
                            capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("sequencer_before", f.name)
    assert spec is not None and spec.loader is not None
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    os.unlink(f.name)

    def noop() -> None:
        return None

    def one_ms() -> None:
        time.sleep(0.001)

    async def measure() -> None:
        loop = asyncio.get_running_loop()
        wakes = 0
        threadsafe = loop.call_soon_threadsafe

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal wakes
            wakes += 1
            return threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        seqs = {f"before ({rev})": before.Sequencer(on_stuck=print), "after (this tree)": now.Sequencer(on_stuck=print)}
        shuffle = random.Random(55)
        for step_name, fn in (("no-op step", noop), ("1 ms step (GIL released)", one_ms)):
            us: dict[str, list[float]] = {name: [] for name in seqs}
            per_step: dict[str, float] = {}
            for _ in range(rounds):
                names = list(seqs)
                shuffle.shuffle(names)
                for name in names:
                    seq = seqs[name]
                    wakes = 0
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        await seq.run(fn, step_timeout_s=30.0, request_deadline=time.monotonic() + 30.0)
                    us[name].append((time.perf_counter() - t0) / calls * 1e6)
                    per_step[name] = wakes / calls
            print(f"sequencer, {step_name}: " + "; ".join(
                f"{name} {statistics.median(v):.1f} us per step ({min(v):.0f}-{max(v):.0f}), "
                f"{per_step[name]:.2f} loop wakes per step" for name, v in us.items())
                + f"; load {os.getloadavg()[0]:.2f}", flush=True)
        for seq in seqs.values():
            seq.shutdown()

    asyncio.run(measure())


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "ws1"
    if what == "ws1":
        ws1(int(sys.argv[2]) if len(sys.argv) > 2 else 7)
    elif what == "header":
        header([float(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "0,50,200").split(",")],
               float(sys.argv[3]) if len(sys.argv) > 3 else 2.0)
    elif what == "ws2":
        ws2(float(sys.argv[2]) if len(sys.argv) > 2 else 2.0, int(sys.argv[3]) if len(sys.argv) > 3 else 400,
            sys.argv[4] if len(sys.argv) > 4 else "cpu")
    elif what == "sequencer":
        sequencer(sys.argv[2] if len(sys.argv) > 2 else "HEAD", int(sys.argv[3]) if len(sys.argv) > 3 else 9)
    else:
        raise SystemExit(f"unknown measurement {what!r}: ws1, ws2, header or sequencer")
