"""`make test`: the whole suite as two pytest runs side by side, `python -m harness.suite`.

Every test is marked `ray` (it uses the session's Ray cluster, or starts Ray itself) or `unit`
(tests/conftest.py refuses anything else), so the two runs below hold every test once:

- the Ray tests, in the foreground, with the output `make test` always had (`-v`, the slowest
  tests and modules at the end): they share one cluster and one Serve instance, so they
  run in one process, in conftest's order;
- the unit tests in a second process meanwhile, their output kept in a file and printed
  after the Ray run's.

Why: the Ray tests leave about a quarter of the two cores idle (they wait on process starts,
timeouts, restarts), and the unit tests need ~180 core-seconds and 3.5-5 minutes. Beside the
Ray tests they no longer add their minutes after them, though they slow the Ray run's first
modules, which compute: one back-to-back pair of `make test` 1,418 -> 1,327 s (bench/NOTES.md,
which also says why the fault tests are not run beside anything). The unit run is niced to
BESIDE_NICENESS: Ray starts its workers at 15, so at 0 the unit run took the cores from the
Ray run's computing modules and the Ray run, the longer of the two, waited on it (one
back-to-back pair 1,135 -> 1,052 s). pytest-xdist's
`--dist loadgroup` would say the same, but with pytest 9.2 it no longer groups (it renames
nodeids, which pytest 9.2 no longer reads), so the two runs are plain processes.

The exit status is 0 when both runs passed, else the Ray run's status if it failed, else the
unit run's. Each test is bounded by pytest-timeout (pyproject.toml); the unit run, once the
Ray run has ended, gets UNIT_RUN_GRACE_S more before it is stopped and reported as such.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.local import ROOT

# How long the unit run may go on after the Ray run ended: alone it takes ~3.5 minutes here.
UNIT_RUN_GRACE_S = 900.0

# The side run's niceness: Ray starts its workers (Serve replicas, ranks, training workers) at 15
# (RAY_worker_niceness), so a side run at 0 took most of the CPU from the Ray run's computing
# modules; at 19 it takes what they leave.
BESIDE_NICENESS = 19

PYTEST = [sys.executable, "-m", "pytest", "tests"]
RAY_RUN = [*PYTEST, "-m", "ray", "-v", "--durations=15"]
# Its own temporary base (pytest's numbered one is shared by concurrent runs) and no cache
# writes (the Ray run keeps .pytest_cache).
UNIT_RUN = [*PYTEST, "-m", "unit", "-q", "--durations=10", "-p", "no:cacheprovider"]


def main() -> int:
    return run_side_by_side(RAY_RUN, UNIT_RUN, UNIT_RUN_GRACE_S)


def run_side_by_side(foreground: list[str], beside: list[str], grace_s: float) -> int:
    """Run `beside` (the unit tests' pytest command line; given its own `--basetemp`, its output kept
    in a file) while `foreground` (the Ray tests') runs with this process's stdout; then print
    `beside`'s output and a one-line summary. `beside` runs in a process group of its own,
    stopped whole (the processes its tests started too) `grace_s` after `foreground` ended if
    it still runs, and whenever this process is interrupted. The exit status: 0 when both
    passed, else `foreground`'s if it failed, else `beside`'s (1 if it was stopped)."""
    with tempfile.TemporaryDirectory(prefix="gangserve-unit-run-") as scratch:
        log_path = Path(scratch) / "beside.log"
        started = time.monotonic()
        with log_path.open("wb") as log:
            side = subprocess.Popen([*beside, "--basetemp", str(Path(scratch) / "tmp")], cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_yield_cpu)
            try:
                front_status = subprocess.run(foreground, cwd=ROOT).returncode
                side_status = _wait(side, grace_s)
            finally:
                if side.poll() is None:  # interrupted: never leave the other run behind
                    _stop_group(side)
        elapsed = time.monotonic() - started
        print(f"\n{'=' * 30} the unit tests (run beside the Ray tests) {'=' * 30}", flush=True)
        sys.stdout.write(log_path.read_text(errors="replace"))
    print(_summary(front_status, side_status, grace_s, elapsed), flush=True)
    if front_status != 0:
        return front_status
    return 0 if side_status == 0 else (side_status if side_status is not None else 1)


def _yield_cpu() -> None:
    """In the side run's process, before it execs (inherited by every process it starts)."""
    os.nice(BESIDE_NICENESS)


def _wait(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """The process's exit status, or None after killing its group at `timeout_s`."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_group(process)
        return None


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group `process` leads (it was started in a session of its own) and
    reap it: killing pytest alone would leave what its tests started (a server, a compiler)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _summary(ray_status: int, unit_status: int | None, grace_s: float, elapsed_s: float) -> str:
    def said(status: int | None) -> str:
        if status is None:
            return f"stopped, still running {grace_s:g} s after the Ray tests ended"
        return "passed" if status == 0 else f"failed (pytest exit status {status})"

    minutes, seconds = divmod(round(elapsed_s), 60)
    return (f"suite: the Ray tests {said(ray_status)}; the unit tests {said(unit_status)}; "
            f"{elapsed_s:.1f} s ({minutes} min {seconds} s) in all")


if __name__ == "__main__":
    sys.exit(main())
