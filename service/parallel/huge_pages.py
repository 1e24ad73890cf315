"""Host tensors on transparent huge pages (Linux's THP, asked for with madvise).

Why: a CPU rank's decode step reads every weight it holds and every page of its sessions' K/V
once. On 4 KiB pages that is a TLB miss every 4 KiB (a session's pages lie anywhere in the
pool); on 2 MiB pages one every 2 MiB. Measured on this project's CPU machine (bench/NOTES.md):
the 12-layer E768 stack's one-row matmuls over its 340 MB of weights 14.1 -> 11.1 ms, the decode
attention of 32 sessions at context 2048 126 -> 110 ms.

How: where /sys/kernel/mm/transparent_hugepage/enabled says "madvise" (Ubuntu's and Debian's
default) a process gets huge pages only for ranges it asks for; "always" gives them anyway,
"never" gives none. A huge page is taken at the first fault in its 2 MiB range, so the ask comes
before the first write: a fresh allocation (untouched), madvise(MADV_HUGEPAGE) over its 2 MiB-
aligned part, then the copy or fill that touches it. Memory touched earlier stays on 4 KiB pages
(until khugepaged merges it, if ever), which is why tensors are moved into fresh storage rather
than advised where they lie. Tensors smaller than a huge page are left alone.

Nothing here fails a rank: where the advice is refused (another OS, a kernel without THP) the
tensors are the same, on 4 KiB pages, and `advice_problem()` says why.
"""
from __future__ import annotations

import mmap
import sys
from pathlib import Path

import torch
from torch import nn


HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB granule) transparent huge page
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ALIGN = 64  # bytes between packed tensors: a cache line, and every dtype's alignment

_ADVISABLE = sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
_problem: str | None = None  # why the last advice was refused, if it was


def thp_mode() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), or why it cannot be read."""
    try:
        text = THP_MODE_FILE.read_text()
    except OSError as exc:
        return f"unknown ({THP_MODE_FILE}: {exc.strerror})"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else f"unknown ({THP_MODE_FILE}: {text.strip()!r})"


def advice_problem() -> str | None:
    """Why this process's tensors are not on huge pages (None: they were asked for; whether the
    kernel grants them also depends on `thp_mode()` and its free huge pages)."""
    if not _ADVISABLE:
        return f"transparent huge pages are Linux's (madvise MADV_HUGEPAGE); this is {sys.platform}"
    mode = thp_mode()
    if mode == "never":
        return f"the kernel's transparent huge pages are off ({THP_MODE_FILE}: never)"
    return _problem


def advice_said() -> str:
    """One phrase for a log line: why this process's tensors are not on huge pages, or that they
    were asked for (and the kernel's mode, which decides whether it grants them)."""
    return advice_problem() or f"asked for (the kernel's mode: {thp_mode()})"


def _fresh_bytes(nbytes: int) -> torch.Tensor:
    """An untouched uint8 CPU tensor of `nbytes` starting on a huge-page boundary, its whole huge
    pages advised. A private anonymous mapping of its own: heap memory (what torch.empty may
    return below glibc's mmap threshold) may have been touched already. One huge page larger, to
    align it: address space, not memory (never touched; the partial page at the end is not
    advised, so it takes 4 KiB pages)."""
    global _problem
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while any view lives
    offset = -whole.data_ptr() % HUGE_PAGE
    advised = nbytes // HUGE_PAGE * HUGE_PAGE
    if advised:
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, advised)
        except OSError as exc:
            _problem = f"madvise(MADV_HUGEPAGE) refused: {exc}"
    return whole[offset:offset + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape, dtype, device), on huge pages where it is a CPU tensor of at least one."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if device.type != "cpu" or nbytes < HUGE_PAGE or not _ADVISABLE:
        return torch.zeros(shape, dtype=dtype, device=device)
    out = _fresh_bytes(nbytes).view(dtype).view(shape)
    out.zero_()  # the first touch: huge pages where granted
    return out


def move_parameters(module: nn.Module, *, keep_values: bool = True) -> int:
    """Move `module`'s CPU parameters of at least one huge page each into one fresh advised
    block, packed (64-byte aligned, so neighbours share huge pages and at most one partial page
    is left at the end). Parameter objects are kept (only `.data` changes); so are their values
    with `keep_values`, else the new storage is untouched until the caller writes every one of
    them (a load, which then takes the huge pages at its first write). Moved one at a time: the
    peak is the block plus one old parameter. Returns the bytes moved."""
    large = [p for p in module.parameters() if p.device.type == "cpu" and p.nbytes >= HUGE_PAGE]
    if not large or not _ADVISABLE:
        return 0
    offsets, total = [], 0
    for p in large:
        offsets.append(total)
        total += -(-p.nbytes // _ALIGN) * _ALIGN
    block = _fresh_bytes(total)
    with torch.no_grad():
        for p, at in zip(large, offsets):
            home = block[at:at + p.nbytes].view(p.dtype).view(p.shape)
            if keep_values:
                home.copy_(p.data)
            p.data = home
    return total
