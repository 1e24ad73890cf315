"""GPU check, tier B: the real rank class (service.gang.worker.Rank) in two processes, no Ray.

Rank 0 (one process, kept across generations, as the GangServer replica is) and a fresh
rank 1 per generation, both on GPU 0: NCCL data group plus gloo control group, the step
loop and `root_step` exactly as the gang drives them.

Two ranks on one GPU: NCCL refuses two ranks of one host on the same device ("Duplicate
GPU detected"; it compares host hash and bus id). Each process gets its own NCCL_HOSTID,
so NCCL takes them for two hosts and connects them over its socket transport on loopback
(NCCL_P2P_DISABLE, NCCL_SHM_DISABLE, NCCL_IB_DISABLE, NCCL_NET=Socket). This is a test
set-up only (one rank per GPU in service). If NCCL still refuses, the generation is run
on gloo with CUDA tensors instead, and the row says so.

Generations (rows printed as measured):
  1. the chosen error mode (TORCH_NCCL_BLOCKING_WAIT=1), fp32 seed weights: parity with
     dense MHA (plain, masked, causal, both), root_step p50 at 128x8x512 and 1x1x512, the
     CUDA-event step clock; rank 1 killed mid-step: the error and how long it took;
     teardown (abort) time.
  2. a second rendezvous in the same rank-0 process, bf16 random weights: parity vs a
     float64 reference; rank 1 stopped mid-step (never returns): the timeout error and
     its time; teardown time with the peer still stopped.
  3. torch's default mode (TORCH_NCCL_BLOCKING_WAIT=0, TORCH_NCCL_ASYNC_ERROR_HANDLING=3):
     the same p50s (the chosen mode's cost is the difference); rank 1 killed mid-step:
     what happens to rank 0's process (the watchdog's SIGABRT is expected).

No wait is blind: every read of a child's answer (`receive`) looks at the children it
depends on every POLL_S, and a child that has exited (an import error, a crash, the
SIGABRT of generation 3) ends the wait at once with a row naming it and its exit code or
signal. A generation that fails leaves rank 0 in an unknown state, so its process is
replaced (a row says so) before the next one. The dry run (GPU_CHECK_DRY_RUN=1: the CPU,
gloo) runs the same drills; in generation 3 its rank 0 aborts itself where NCCL's watchdog
would, so the path that sees a process die is exercised too (the row says it is emulated).
"""
from __future__ import annotations

import os
import queue
import signal
import sys
import time
from typing import Any

from common import exit_text, row, section, wall_ms  # noqa: E402  (sets sys.path)

import numpy as np
import torch
import torch.multiprocessing as mp

E, H = 512, 8
# GPU_CHECK_DRY_RUN=1: the same drills on the CPU with gloo (checks this script, not the GPU path).
DRY_RUN = os.environ.get("GPU_CHECK_DRY_RUN") == "1"
DEVICE = "cpu" if DRY_RUN else "cuda"
CASES = {"plain": (False, False), "masked": (True, False), "causal": (False, True), "masked+causal": (True, True)}
SAME_GPU_NCCL = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
                 "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
VERBS = {"kill": "killed", "stop": "stopped (never returns)"}
DEFAULT_MODE = {"TORCH_NCCL_BLOCKING_WAIT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
# Bounds of the waits on the children (each a bound, not an expected time). Measured by the
# CPU dry run here (2 busy cores): a child's start (interpreter, torch, the rank class) 2-4 s,
# a gloo rendezvous 1.6-1.9 s, a generation's steps and p50 loops 2-4 s, the drill's error
# 0.05 s (kill) and 5.0 s (stop: the group timeout). On the GPU a CUDA context (1-3 s) and
# NCCL's communicator over its socket transport (1-5 s) come on top; the bounds leave room.
POLL_S = 0.25  # how often a wait looks at whether the children it depends on are alive
START_S = 45.0  # a child's start: interpreter, torch, the rank class, its CUDA context
STEPS_S = 30.0  # one message of a generation's steps (the p50 loops are the longest)
DRILL_S = 15.0  # beyond the group timeout: the error's way back, the teardown
TEARDOWN_BOUND_S = 10.0  # Rank.close's own bound (GangTunables().shutdown_timeout_s)
PLANS = [  # (generation, weights init, compute dtype, group timeout s, error-mode env, drill)
    (1, "seed", "float32", 10.0, {}, "kill"),
    (2, "random", "bfloat16", 5.0, {}, "stop"),
    (3, "seed", "float32", 10.0, DEFAULT_MODE, "kill"),
]


def _inputs(batch: int = 4, seq: int = 24) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(3).standard_normal((batch, seq, E)).astype(np.float32)
    mask = np.ones((batch, seq), dtype=np.bool_)
    mask[1, :3] = False
    mask[2, seq - 5:] = False
    return x, mask


class Driver:
    """Rank 0's side of a step, as the gang's sequencer does it (service.gang.gang.Gang._run_step)."""

    def __init__(self, rank: Any) -> None:
        self.rank, self.seq = rank, 0

    def step(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool = False, between: Any = None) -> np.ndarray:
        from service.gang.steps import Forward

        self.seq += 1
        step = Forward(x, mask, causal)
        self.rank.send_header(step.kind.header(self.seq, self.rank.dtype, 1, time.time_ns(), step.fields()))
        self.rank.step_seq = self.seq
        if between is not None:
            between()
        return step.root(self.rank, 1)


def _peer_main(out: Any, port: int, backend: str, model: Any, timeout_s: float, env: dict[str, str],
               gen: int) -> None:
    os.environ.update(env)
    os.environ["NCCL_HOSTID"] = f"gangserve-check-peer-{gen}"
    from service.gang.worker import Rank

    rank = Rank(1, 2, device=torch.device(DEVICE, 0), node_ip="127.0.0.1", device_how="tier B peer")
    out.put(("peer up",))  # as a gang's rank actors are up before rank 0 waits for them
    rank.rendezvous("127.0.0.1", port, backend, timeout_s)
    rank.load_weights(model, 1)
    rank.start_loop()
    rank._loop.join()  # type: ignore[union-attr]  (a failed loop exits the process itself)


def _root_main(out: Any, cmd: Any) -> None:
    os.environ["NCCL_HOSTID"] = "gangserve-check-rank0"
    from service.gang.worker import PlainModel, Rank

    while True:
        plan = cmd.get(timeout=300)
        if plan is None:
            return
        gen, backend, init, dtype, timeout_s, env, drill = plan
        os.environ.update(env)
        model = PlainModel(embed_dim=E, num_heads=H, init=init, seed=7, compute_dtype=dtype)
        rank = Rank(0, 2, device=torch.device(DEVICE, 0), node_ip="127.0.0.1", device_how="tier B rank 0")
        out.put(("port", rank.open_store(timeout_s), model))
        # The rendezvous begins once rank 1's process is up (its start is bounded apart: a
        # loaded machine took > 10 s to start one, more than a group timeout).
        told = cmd.get(timeout=START_S + 60)  # queue.Empty past the bound: this process ends
        if told != "rendezvous":
            raise RuntimeError(f"rank 0 expected 'rendezvous' after sending its port, was told {told!r}")
        started = time.monotonic()
        try:
            rank.rendezvous("127.0.0.1", 0, backend, timeout_s)
            rank.load_weights(model, 1)
        except Exception as exc:
            out.put(("rendezvous failed", f"{type(exc).__name__}: {str(exc)[:400]}"))
            try:
                rank.close()
            except Exception:
                pass
            continue
        out.put(("rendezvous", time.monotonic() - started,
                 {k: os.environ.get(k) for k in ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}))
        drive = Driver(rank)
        x, mask = _inputs()
        for name, (masked, causal) in CASES.items():
            if gen == 2 and name != "masked+causal":
                continue
            out.put(("out", name, drive.step(x, mask if masked else None, causal)))
        big = np.random.default_rng(0).standard_normal((128, 8, E)).astype(np.float32)
        small = big[:1, :1].copy()
        if gen != 2:
            out.put(("p50", "128x8x512", wall_ms(lambda: drive.step(big), n=30)))
            clocks = []
            for _ in range(10):
                drive.step(big)
                clocks.append((rank.last_forward_ns - rank.last_bcast_ns) / 1e6)
            out.put(("p50", "128x8x512, its step clock's broadcast -> forward (CUDA events)", sorted(clocks)[5]))
            out.put(("p50", "1x1x512", wall_ms(lambda: drive.step(small), n=30)))
        out.put(("drill", drill))
        assert cmd.get(timeout=60) == "go"
        started = time.monotonic()
        try:
            drive.step(big, between=lambda: out.put(("in-step",)))
            out.put(("error", time.monotonic() - started, "no error: the step completed"))
        except Exception as exc:
            if DRY_RUN and env == DEFAULT_MODE:
                os.abort()  # what NCCL's watchdog does to this process in torch's default mode
            out.put(("error", time.monotonic() - started, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))
        started = time.monotonic()
        try:
            rank.close()
            out.put(("closed", time.monotonic() - started, "ok"))
        except Exception as exc:
            out.put(("closed", time.monotonic() - started, f"{type(exc).__name__}: {str(exc)[:200]}"))


def _reference(model: Any, x: np.ndarray, mask: np.ndarray | None, causal: bool) -> torch.Tensor:
    from harness.reference import dense_attention_masked
    from service.parallel.weights import random_weights, seed_weights

    weights = seed_weights(E) if model.init == "seed" else random_weights(E, model.seed)
    ref = torch.float32 if model.compute_dtype == "float32" else torch.float64
    return dense_attention_masked({k: v.to(ref) for k, v in weights.items()}, H, torch.from_numpy(x).to(ref),
                                  None if mask is None else torch.from_numpy(mask).int(), causal)


class ChildGone(RuntimeError):
    """A child the tier was waiting on has exited (the message says which, and how)."""


def receive(out: Any, timeout_s: float, awaited: str, **children: Any) -> Any:
    """The next message on `out` within `timeout_s`. Never a blind wait: every POLL_S it
    looks at each named child (multiprocessing Processes), and one that has exited ends the
    wait at once with ChildGone naming it and its exit code or signal (after taking any
    message it put before it went). Past `timeout_s`: TimeoutError naming what was awaited
    and each child's state."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return out.get(timeout=max(0.01, min(POLL_S, deadline - time.monotonic())))
        except queue.Empty:
            pass
        gone = {name: proc.exitcode for name, proc in children.items() if proc.exitcode is not None}
        if gone:
            try:  # its last message may still be in the pipe
                return out.get(timeout=POLL_S)
            except queue.Empty:
                raise ChildGone(f"while waiting for {awaited}: " + ", ".join(
                    f"{name}'s process {exit_text(code)}" for name, code in gone.items())) from None
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no {awaited} within {timeout_s:.0f}s (" + ", ".join(
                f"{name}'s process {exit_text(proc.exitcode)}" for name, proc in children.items()) + ")")


class RankZero:
    """Rank 0's process, kept across generations as the GangServer replica is, with the
    queues it answers on and takes its plans from."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.start()

    def start(self) -> None:
        self.out, self.cmd = self.ctx.Queue(), self.ctx.Queue()
        self.proc = self.ctx.Process(target=_root_main, args=(self.out, self.cmd), daemon=True)
        self.proc.start()

    def replace(self) -> None:
        """A fresh process (the old one's state is unknown after a failed generation)."""
        _stop(self.proc)
        self.start()


def main() -> int:
    if not torch.cuda.is_available() and not DRY_RUN:
        row("tier B", f"no CUDA: tier skipped (torch {torch.__version__}, cuda {torch.version.cuda})")
        return 0
    from harness.reference import relative_error
    from service.gang.worker import RENDEZVOUS_WAITS

    os.environ.update(SAME_GPU_NCCL)
    ctx = mp.get_context("spawn")
    zero = RankZero(ctx)
    backend = "gloo" if DRY_RUN else "nccl"
    if DRY_RUN:
        row("tier B", "DRY RUN on the CPU with gloo: checks the script only")
    x, mask = _inputs()
    peer = None
    try:
        for gen, init, dtype, timeout_s, env, drill in PLANS:
            done = False
            with section(f"generation {gen}"):
                mode = "default mode" if env else "chosen mode"
                tag = f"g{gen} {backend} {mode} {dtype} {init}"
                out, root = zero.out, {"rank 0": zero.proc}
                zero.cmd.put((gen, backend, init, dtype, timeout_s, env, drill))
                _, port, model = receive(out, START_S, "rank 0's store", **root)
                peer = ctx.Process(target=_peer_main, args=(out, port, backend, model, timeout_s, env, gen), daemon=True)
                peer.start()
                both = {**root, "rank 1": peer}
                # The peer's start, then the rendezvous's own bound (3 group timeouts).
                up = receive(out, START_S, "rank 1's start", **both)
                if up[0] != "peer up":
                    raise RuntimeError(f"rank 1's start expected, rank 0 sent {up[0]!r} first")
                zero.cmd.put("rendezvous")
                msg = receive(out, RENDEZVOUS_WAITS * timeout_s + POLL_S, "the rendezvous", **both)
                if msg[0] == "rendezvous failed":
                    row(f"{tag}: rendezvous", f"FAILED: {msg[1]}")
                    _stop(peer)
                    if backend == "nccl" and gen == 1:
                        backend = "gloo"  # the rest of the tier on gloo with CUDA tensors
                        row("two ranks on one GPU", "NCCL refused; the following generations use gloo on CUDA")
                    done = True
                    continue
                how = "eager NCCL init" if backend == "nccl" else "gloo"
                row(f"{tag}: rendezvous ({how}) s", f"{msg[1]:.2f} (env {msg[2]})")
                while True:
                    msg = receive(out, STEPS_S, "rank 0's steps", **both)
                    if msg[0] == "out":
                        masked, causal = CASES[msg[1]]
                        want = _reference(model, x, mask if masked else None, causal)
                        row(f"{tag}: rel err vs dense, {msg[1]}", f"{relative_error(torch.from_numpy(msg[2]), want):.2e}")
                    elif msg[0] == "p50":
                        row(f"{tag}: root_step p50 ms, {msg[1]}", f"{msg[2]:.3f}")
                    else:
                        break
                _drill(zero, peer, tag, drill, backend, timeout_s)
                _stop(peer)
                done = True
            if zero.proc.exitcode is not None and gen < len(PLANS):
                row(f"{tag}: rank 0", f"its process {exit_text(zero.proc.exitcode)}; a fresh one for the next generation")
                zero.replace()
            elif not done:  # the generation failed: rank 0's state is unknown
                if peer is not None:
                    _stop(peer)
                row(f"{tag}: rank 0", "a fresh process for the next generation (this one failed)")
                zero.replace()
    finally:
        zero.cmd.put(None)
        for proc in (peer, zero.proc):
            if proc is not None:
                _stop(proc)
    return 0


def _drill(zero: RankZero, peer: Any, tag: str, drill: str, backend: str, timeout_s: float) -> None:
    """Rank 1 stops taking part in a step rank 0 has begun. Rows: what rank 0 got and when,
    then its teardown; or, when rank 0's process dies instead (the watchdog's SIGABRT in
    torch's default mode), how and when, seen within POLL_S of the death."""
    root = {"rank 0": zero.proc}
    os.kill(peer.pid, signal.SIGSTOP)  # rank 1 takes no part in the next step
    zero.cmd.put("go")
    receive(zero.out, STEPS_S, "rank 0's next step", **root)  # "in-step": its header is out
    started = time.monotonic()
    if drill == "kill":
        os.kill(peer.pid, signal.SIGKILL)
    what = f"{tag}: rank 1 {VERBS[drill]} mid-step -> rank 0"
    try:
        # The collective times out after timeout_s (blocking wait), or the watchdog acts after it.
        _, elapsed, why = receive(zero.out, DRILL_S + 2 * timeout_s, "rank 0's error", **root)
        row(what, f"{why} after {elapsed:.2f}s")
        # Rank.close is bounded by its own shutdown bound (GangTunables.shutdown_timeout_s, 10 s);
        # the rest is margin for a loaded machine (a make test run once took > 25 s here).
        _, closed_s, how = receive(zero.out, DRILL_S + timeout_s + TEARDOWN_BOUND_S, "rank 0's teardown", **root)
        row(f"{tag}: teardown ({'abort' if backend == 'nccl' else 'destroy'}) s", f"{closed_s:.3f} ({how})")
    except ChildGone:
        code = zero.proc.exitcode
        expected = ("expected: torch's watchdog, TORCH_NCCL_ASYNC_ERROR_HANDLING=3"
                    + ("; emulated by the dry run" if DRY_RUN else "")) if code == -signal.SIGABRT else "unexpected"
        row(what, f"its process {exit_text(code)}, seen {time.monotonic() - started:.2f}s after the drill "
                  f"began ({expected})")


def _stop(proc: Any) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
