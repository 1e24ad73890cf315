"""Pinned host buffers for a CUDA rank 0's copies in and out.

A copy between pageable host memory and a GPU goes through a driver staging buffer, in
chunks, synchronously; from page-locked (pinned) memory it is one DMA that can be queued
(`non_blocking=True`). Rank 0 copies every request in and every reply out, so it keeps
one grow-only pinned buffer each way (float32: the wire dtype), reused step after step.
Reuse is safe because the sequencer runs one step at a time and each step waits for its
reply copy before returning (the next step writes the buffers only after that).
"""
from __future__ import annotations

import numpy as np
import torch


class PinnedStaging:
    """Rank 0's grow-only pinned float32 buffers: `upload` builds a step's data buffer on
    the device, `download` brings its output back as a numpy array the caller owns."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"pinned staging is for a CUDA device, not {device}")
        self.device = device
        self._in = torch.empty(0, dtype=torch.float32)
        self._out = torch.empty(0, dtype=torch.float32)

    @staticmethod
    def _grown(buf: torch.Tensor, n: int) -> torch.Tensor:
        if buf.numel() >= n:
            return buf
        # Grow by at least 2x so a slowly rising size does not re-pin on every step.
        return torch.empty(max(n, 2 * buf.numel()), dtype=torch.float32, pin_memory=True)

    @property
    def pinned_bytes(self) -> int:
        return (self._in.numel() + self._out.numel()) * 4

    def upload(self, x: np.ndarray, mask: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor:
        """[x.flatten(), mask.flatten() as 0/1] on the device in `dtype` (x float32 [b, s, E])."""
        n = x.size
        total = n + (mask.size if mask is not None else 0)
        self._in = self._grown(self._in, total)
        host = self._in[:total]
        host[:n].copy_(torch.from_numpy(x).reshape(-1))
        if mask is not None:
            host[n:].copy_(torch.from_numpy(np.ascontiguousarray(mask, dtype=np.bool_)).reshape(-1))
        dev = host.to(self.device, non_blocking=True)
        return dev if dtype == torch.float32 else dev.to(dtype)

    def download(self, out: torch.Tensor) -> np.ndarray:
        """out (any float dtype, on the device) as a float32 numpy array of the same shape."""
        n = out.numel()
        self._out = self._grown(self._out, n)
        host = self._out[:n]
        host.copy_(out.to(torch.float32).reshape(-1), non_blocking=True)  # the cast runs on the device
        torch.cuda.current_stream(self.device).synchronize()
        return host.numpy().reshape(tuple(out.shape)).copy()  # the buffer is reused next step
