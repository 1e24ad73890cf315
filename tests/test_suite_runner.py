"""`make test`'s runner (harness/suite.py): two real pytest runs side by side, on small test
files of this test's own; what it prints and the status it exits with."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from harness.suite import BESIDE_NICENESS, run_side_by_side

pytestmark = pytest.mark.unit


def pytest_command(tmp_path: Path, name: str, body: str) -> list[str]:
    """A pytest command line for one test file `name` holding `body`, rooted in `tmp_path`."""
    path = tmp_path / name
    path.write_text(body)
    return [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
            "-c", str(tmp_path / "empty.ini")]


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    (tmp_path / "empty.ini").write_text("[pytest]\n")
    return tmp_path


def test_both_pass_and_the_side_run_is_printed_after_the_foreground(runs: Path, capfd: pytest.CaptureFixture[str]) -> None:
    front = pytest_command(runs, "test_front.py", "def test_front_marker_1():\n    pass\n")
    side = pytest_command(runs, "test_side.py", "def test_side_marker_2():\n    print('side says hi')\n    assert False\n")
    niceness = runs / "side-niceness"
    side_ok = pytest_command(runs, "test_side_ok.py", (
        f"import os\n\ndef test_side_marker_3():\n    open({str(niceness)!r}, 'w').write(str(os.nice(0)))\n"))
    assert run_side_by_side(front, side_ok, grace_s=60) == 0
    # The side run yields the CPU to the Ray run's workers (niceness 15 under Ray).
    assert int(niceness.read_text()) == BESIDE_NICENESS
    out = capfd.readouterr().out
    assert out.index("1 passed") < out.index("the unit tests (run beside the Ray tests)") < out.rindex("1 passed")
    assert "suite: the Ray tests passed; the unit tests passed;" in out.splitlines()[-1]

    # A failure beside: its status, and its report printed.
    assert run_side_by_side(front, side, grace_s=60) == 1
    out = capfd.readouterr().out
    assert "side says hi" in out and "test_side_marker_2" in out
    assert "the unit tests failed (pytest exit status 1)" in out.splitlines()[-1]


def test_a_failed_foreground_wins_and_a_side_run_past_its_grace_is_stopped(
        runs: Path, capfd: pytest.CaptureFixture[str]) -> None:
    front_fails = pytest_command(runs, "test_front_fails.py", "def test_front():\n    assert 1 == 2\n")
    child_pid = runs / "child.pid"
    side_hangs = pytest_command(runs, "test_side_hangs.py", (
        "import subprocess, sys, time\n\ndef test_side():\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"    open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(120)\n"))
    started = time.monotonic()
    assert run_side_by_side(front_fails, side_hangs, grace_s=8) == 1  # time to start its child
    assert time.monotonic() - started < 60, "the side run was not stopped at its grace"
    pid = int(child_pid.read_text())
    assert not _alive(pid), f"the side run's test left its child {pid} running"
    last = capfd.readouterr().out.splitlines()[-1]
    assert "the Ray tests failed (pytest exit status 1)" in last and "the unit tests stopped, still running 8 s" in last

    front_passes = pytest_command(runs, "test_front_passes.py", "def test_front():\n    pass\n")
    assert run_side_by_side(front_passes, side_hangs, grace_s=0.5) == 1  # stopped counts as failed
    assert "the Ray tests passed; the unit tests stopped" in capfd.readouterr().out.splitlines()[-1]


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie left for its new parent to reap does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
