"""Keep freed request-sized buffers in the process's heap instead of giving them back to the OS.

glibc's malloc serves a large allocation (128 KiB at first, growing to at most 32 MiB after
frees) with a fresh mmap, and unmaps it on free; it also returns the top of the heap to the OS
once more than 128 KiB is free there. Every request on the path allocates tensors of its own
size: the body read, the output copied out of the shared region, the encoded reply, the step's
input and output on each rank. Each fresh mapping is paid page by page on first touch: measured
here, encoding a copied [128, 8, 512] float32 output took 2.3 ms, of which 2.2 ms were page
faults; with the thresholds below, 0.08 ms (bench/NOTES.md, issue 44).

    M_MMAP_THRESHOLD = MMAP_THRESHOLD_BYTES: allocations below it come from the heap;
    M_TRIM_THRESHOLD = TRIM_THRESHOLD_BYTES: the heap keeps this much freed memory.

The cost: a process's resident memory stays near its peak (up to TRIM_THRESHOLD_BYTES of freed
memory per malloc arena) instead of shrinking after a burst. Only glibc has mallopt; elsewhere
(musl, macOS) nothing is changed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("gangserve.heap")

# A request body is at most max_body_bytes (64 MiB by default): its buffers stay in the heap.
MMAP_THRESHOLD_BYTES = 64 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 128 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>


def keep_freed_buffers() -> bool:
    """Set this process's malloc thresholds (see the module docstring); True when set. Safe to
    call more than once (rank 0 shares its process with the GangServer)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no glibc mallopt (%s): malloc's thresholds left as they are", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
