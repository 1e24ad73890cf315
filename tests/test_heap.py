"""service.cluster.heap: a request-sized buffer freed and allocated again reuses the heap's
pages instead of faulting in fresh ones (each case in its own process: malloc's thresholds
are process-wide). Counted by the kernel (minor page faults), not timed."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

# What the ingress does with a [128, 8, 512] float32 output (2 MiB, 512 pages), 20 times after
# a warm-up: copy it out of the shared region, encode it (npy: a header and the data joined
# into one bytes object), free both; print the minor page faults those 20 rounds cost.
_ROUNDS = """
import resource, sys
import numpy as np
if sys.argv[1] == "kept":
    from service.cluster.heap import keep_freed_buffers
    assert keep_freed_buffers()
src = np.ones((128, 8, 512), dtype=np.float32)
header = b"\\x93NUMPY" + b" " * 122
def reply():
    out = src.copy()
    return len(b"".join([header, memoryview(out).cast("B")]))
for _ in range(3):
    reply()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    reply()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=60, check=True)
    return int(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_a_freed_reply_buffer_is_reused_without_page_faults() -> None:
    default, kept = _faults("default"), _faults("kept")
    # glibc's default gives the two freed buffers back to the OS (their 4 MiB exceed its
    # dynamic trim threshold) and faults them in again next round: ~1000 faults a round.
    # Kept: the same heap pages every round.
    assert kept < 50, f"{kept} minor page faults in 20 rounds with the buffers kept (default: {default})"
    assert default > 10 * max(kept, 1), (default, kept)
