"""Shared by the GPU check's tiers: rows printed the moment they are measured, sections
that report their own failure and let the next one run. Standard library and torch only."""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]
for path in (str(ROOT), str(ROOT / "clients")):
    if path not in sys.path:
        sys.path.insert(0, path)

_TIER = os.environ.get("GPU_CHECK_TIER", "?")


def row(name: str, value: object) -> None:
    """One markdown row, flushed at once (a later crash loses nothing already measured)."""
    print(f"| {_TIER} | {name} | {value} |", flush=True)


@contextmanager
def section(name: str) -> Iterator[None]:
    """A named part of a tier: its failure is one row with the error and where, then the tier goes on."""
    started = time.monotonic()
    try:
        yield
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        row(f"{name}: FAILED", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''} "
                               f"(at {Path(where.filename).name}:{where.lineno})")
        traceback.print_exc(file=sys.stderr)
    finally:
        print(f"# {name}: {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)


def exit_text(code: int | None) -> str:
    """A child's exit status in words: its code, or the signal that ended it (multiprocessing's
    exitcode and subprocess's returncode are both -N for signal N)."""
    if code is None:
        return "is running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def cuda_event_ms(fn: Callable[[], object], n: int = 50, warmup: int = 5) -> float:
    """Median GPU time of fn (CUDA events around each call), ms."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def wall_ms(fn: Callable[[], object], n: int = 50, warmup: int = 5) -> float:
    """Median wall time of fn (which must synchronize itself), ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return times[len(times) // 2]
