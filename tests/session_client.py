"""A session driven over HTTP, checked against the dense reference: shared by the session
tests (tests/test_sessions.py) and the fault tests that kill a rank under sessions
(tests/test_gang_faults.py)."""
from __future__ import annotations

import io
from typing import Any

import httpx
import numpy as np
import torch

from tests.helpers import npy_bytes
from tests.reference import reference, relative_error

TOL = 1e-5
E = 512


class HttpSession:
    """A session driven over HTTP (npy bodies), with the expected outputs tracked: each answer is
    checked against the dense reference (torch's MultiheadAttention, causal, over the session's
    whole sequence) holding `weights`, the app's (None: the notes' seed weights)."""

    def __init__(self, base: str, weights: dict[str, torch.Tensor] | None, prefill: np.ndarray | None = None) -> None:
        self.base = base
        self.weights = weights
        self.seq = np.zeros((0, E), np.float32)
        if prefill is None:
            r = httpx.post(f"{base}/sessions", timeout=60)
            assert r.status_code == 201, r.text
            self.id = r.json()["session_id"]
        else:
            r = httpx.post(f"{base}/sessions", content=npy_bytes(prefill),
                           headers={"content-type": "application/x-npy"}, timeout=60)
            assert r.status_code == 201, r.text
            self.id = r.headers["x-session-id"]
            self.check(prefill, r)

    def append(self, rows: np.ndarray, key: str | None = None, **params: Any) -> httpx.Response:
        """POST the rows (with `key` as its Idempotency-Key, if given); a 200 is checked and its
        rows join the expected sequence."""
        headers = {"content-type": "application/x-npy", **({"idempotency-key": key} if key is not None else {})}
        r = httpx.post(f"{self.base}/sessions/{self.id}/append", content=npy_bytes(rows), params=params,
                       headers=headers, timeout=60)
        if r.status_code == 200:
            self.check(rows, r)
        return r

    def check(self, rows: np.ndarray, r: httpx.Response) -> None:
        self.seq = np.concatenate([self.seq, rows])
        out = np.load(io.BytesIO(r.content))
        assert out.shape == rows.shape, (out.shape, rows.shape)
        want = reference(self.seq, causal=True, weights=self.weights)[-len(rows):]
        err = relative_error(torch.from_numpy(out), want)
        assert err <= TOL, f"session {self.id} at length {len(self.seq)}: relative error {err:.3e}"
        assert int(r.headers["x-session-length"]) == len(self.seq)
        assert r.headers["x-weights-version"].isdigit()

    def info(self) -> dict:
        r = httpx.get(f"{self.base}/sessions/{self.id}", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()
