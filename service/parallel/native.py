"""This package's C++ kernels, built on the machine that runs them and loaded through ctypes:
the sessions' decode attention (paged_decode.cpp, service.parallel.paged_kernel) and the few-row
weight matmul (gemv.cpp, service.parallel.linear).

Contract of `load(source, budget_s)`: the library built from `source` (a file beside this
module), in this process at most once; built first when this machine has none cached, the build
bounded by `budget_s`; BuildFailed says what failed (no compiler, a compiler error, the budget).

How:
- The compiler: $CXX, else the first of COMPILERS on PATH (`compiler_problem`).
- Flags: `-O3 -march=native -ffast-math -fopenmp` to compile, without -ffast-math to link
  (COMPILE_FLAGS says why). `-march=native`: built for this CPU, so never at image build time.
- The cache: $GANGSERVE_KERNEL_DIR, else <tmp>/gangserve_kernels_<uid>, one file per source
  named by a hash of the source, the flags, the compiler and the CPU's feature flags, so a
  later process (every rank after the first on a node) loads it in milliseconds.
- No lock: a build writes temporary names and renames the result into place, so ranks building
  at once on one node never wait on each other (torch's `load_inline` waits on its lock file
  without a bound: a rank killed mid-build would hang every later one). Each compiler call runs
  in a process group of its own, killed whole when the budget is spent.
- The libraries link `libgomp.so.1`, the soname torch's own OpenMP runtime carries, so the
  process keeps one OpenMP runtime and one thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

# Compiled with -ffast-math (the reductions and exp vectorised; the kernels keep their arithmetic
# finite), linked without it: linking with it adds crtfastmath.o, whose constructor sets the CPU's
# flush-to-zero mode for the whole process when the library loads, and every torch op after it
# would lose denormals.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
COMPILER_ENV = "CXX"  # the compiler to use, if set
COMPILERS = ("g++", "c++", "clang++")  # else the first of these on PATH
KERNEL_DIR_ENV = "GANGSERVE_KERNEL_DIR"  # where built kernels are kept (default: a per-user temp dir)


class BuildFailed(RuntimeError):
    """A kernel could not be built or loaded on this machine (its caller keeps its torch path)."""


def compiler_problem() -> str | None:
    """Why no kernel can be built here (None: a compiler is found)."""
    try:
        _compiler()
    except FileNotFoundError as exc:
        return f"no C++ compiler for the native kernels (FileNotFoundError: {exc})"
    return None


def _compiler() -> str:
    """The C++ compiler's full path: $CXX if set, else the first of COMPILERS on PATH."""
    wanted = os.environ.get(COMPILER_ENV)
    for name in [wanted] if wanted else COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(f"$CXX={wanted!r} is not on PATH" if wanted else f"none of {', '.join(COMPILERS)} on PATH")


def _kernel_dir() -> Path:
    """The cache of built kernels: $GANGSERVE_KERNEL_DIR, else <tmp>/gangserve_kernels_<uid>; a
    directory another user owns is not trusted (a private temporary one is used instead)."""
    configured = os.environ.get(KERNEL_DIR_ENV)
    path = Path(configured) if configured else Path(tempfile.gettempdir()) / f"gangserve_kernels_{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        return Path(tempfile.mkdtemp(prefix="gangserve_kernels_"))
    return path


def _cpu_flags() -> str:
    """This CPU's feature flags (`-march=native` builds for them): part of the cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


_loaded: dict[str, ctypes.CDLL] = {}  # source file name -> its library, in this process


def load(source: str, budget_s: float) -> ctypes.CDLL:
    """The library of `source` (a file name beside this module): see the module docstring."""
    if source in _loaded:
        return _loaded[source]
    path = Path(__file__).with_name(source)
    try:
        compiler = _compiler()
        directory = _kernel_dir()
        source_bytes = path.read_bytes()
    except OSError as exc:  # no compiler, an unusable kernel directory, a missing source
        raise BuildFailed(str(exc)) from exc
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS).encode()
    key = hashlib.sha256(b"\0".join([source_bytes, flags, compiler.encode(), _cpu_flags().encode(),
                                     platform.machine().encode()])).hexdigest()[:20]
    target = directory / f"{path.stem}_{key}.so"
    if not target.exists():
        _build(compiler, path, directory, target, max(budget_s, 1.0))
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        raise BuildFailed(f"could not load the built kernel {target}: {exc}") from exc
    _loaded[source] = library
    return library


def _build(compiler: str, source: Path, directory: Path, target: Path, budget_s: float) -> None:
    """Compile `source` into `target` (compile, then link: see COMPILE_FLAGS) under temporary
    names, then rename it into place (a rank building beside this one renames the same bytes)."""
    deadline = time.monotonic() + budget_s
    partial = objects = ""
    try:
        fd, partial = tempfile.mkstemp(dir=directory, prefix=target.name, suffix=".partial")  # a name of its own
        os.close(fd)
        objects = partial + ".o"
        _run_step([compiler, *COMPILE_FLAGS, str(source), "-o", objects], source, deadline, budget_s)
        _run_step([compiler, *LINK_FLAGS, objects, "-o", partial], source, deadline, budget_s)
        os.replace(partial, target)
    except OSError as exc:
        raise BuildFailed(f"could not run {compiler} into {directory}: {exc}") from exc
    finally:
        for leftover in filter(None, (partial, objects)):
            Path(leftover).unlink(missing_ok=True)


def _run_step(command: list[str], source: Path, deadline: float, budget_s: float) -> None:
    """One compiler call in a process group of its own, killed whole at `deadline`: killing the
    driver alone would leave its cc1plus holding the pipe, and reading it would wait for it."""
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        _, errors = child.communicate(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        try:
            child.communicate(timeout=10)  # reap it; the whole group is gone, so the pipe closes
        except subprocess.TimeoutExpired:
            pass
        raise BuildFailed(f"building {source.name} took more than {budget_s:g}s") from None
    if child.returncode != 0:
        first = next((line for line in errors.splitlines() if "error" in line), errors.strip())
        raise BuildFailed(f"{command[0]} failed to build {source.name} (exit {child.returncode}): {first[:200]}")
