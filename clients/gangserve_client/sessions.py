"""A stateful session of the gangserve API (POST /sessions, .../append, GET/DELETE /sessions/{id}).

    with GangServeClient(url) as c, c.session(prefill=x0) as s:   # x0 [n, E] (optional)
        y = s.append(row)          # row [n, E] -> the outputs of those rows, [n, E]
        s.length, s.weights_version

    async with AsyncGangServeClient(url) as c:                    # the same, awaited
        async with await c.session(prefill=x0) as s:
            y = await s.append(row)

Each `append` is applied exactly once, however often it is retried: it carries an
`Idempotency-Key` (a fresh uuid4 per `append`, the same on each of its attempts), and an
attempt after one that the service did apply (its answer lost, or the client's own timeout
passed first) gets that answer back instead of appending again. So a lost connection and a
timeout (`timeout_s`) are retried for appends (gangserve_client.retries). Each `append` also
sends `?length=` (the session's length before it): should the service have forgotten the key
(it remembers a session's last 16 by default), a retry is refused (409
`session_length_mismatch`) rather than applied twice. `weights_version` is the version the last answer was computed with.
Leaving the `with` block ends the session (DELETE).
"""
from __future__ import annotations

import uuid
from typing import Any, Protocol

import httpx
import numpy as np

from gangserve_client.errors import NotFoundError
from gangserve_client.replies import decode_reply, session_info


def new_key() -> str:
    """A fresh idempotency key for one append (a uuid4; the service takes 1-128 visible ASCII characters)."""
    return str(uuid.uuid4())


class SessionCalls(Protocol):
    """What a Session needs of its client (GangServeClient): one retried call, and a session call."""

    def _request(self, method: str, path: str, *, idempotent: bool = True, **kwargs: Any) -> httpx.Response: ...

    def _session_request(self, path: str, rows: np.ndarray, fmt: str, deadline_s: float | None,
                         params: dict[str, str] | None = None, idempotent: bool = True,
                         key: str | None = None) -> httpx.Response: ...

    def _infer_headers(self) -> dict[str, str]: ...


class AsyncSessionCalls(Protocol):
    """What an AsyncSession needs of its client (AsyncGangServeClient): SessionCalls, awaited."""

    async def _request(self, method: str, path: str, *, idempotent: bool = True, **kwargs: Any) -> httpx.Response: ...

    async def _session_request(self, path: str, rows: np.ndarray, fmt: str, deadline_s: float | None,
                               params: dict[str, str] | None = None, idempotent: bool = True,
                               key: str | None = None) -> httpx.Response: ...

    def _infer_headers(self) -> dict[str, str]: ...


class Session:
    """One session; made by `GangServeClient.session()` (a prefill's outputs are in `prefill_output`)."""

    def __init__(self, client: SessionCalls, info: dict[str, Any], prefill_output: np.ndarray | None = None) -> None:
        self._client = client
        self.id: str = str(info["session_id"])
        self.info: dict[str, Any] = info
        self.prefill_output = prefill_output

    @property
    def length(self) -> int:
        return int(self.info.get("length", 0))

    @property
    def weights_version(self) -> int:
        return int(self.info.get("weights_version", 0))

    @property
    def replayed(self) -> bool:
        """The last append's answer was remembered by the service for a retried attempt (its
        first attempt was applied, and its answer lost or late), not computed again."""
        return bool(self.info.get("replayed", False))

    def append(self, rows: np.ndarray, fmt: str = "safetensors", *, deadline_s: float | None = None) -> np.ndarray:
        """rows [n, E] (or [1, n, E]) -> their outputs, same shape; each attends causally to the
        whole session so far. Applied once, whatever is retried (see the module docstring);
        `replayed` then says whether the answer was remembered for a retried attempt."""
        reply = self._client._session_request(f"/sessions/{self.id}/append", rows, fmt, deadline_s,
                                              params={"length": str(self.length)}, key=new_key())
        self.info = session_info(reply, self.info)
        return decode_reply(reply)

    def refresh(self) -> dict[str, Any]:
        """GET /sessions/{id}: length, weights version, created, last used, bytes held."""
        self.info = self._client._request("GET", f"/sessions/{self.id}", headers=self._client._infer_headers()).json()
        return self.info

    def close(self) -> None:
        """DELETE /sessions/{id} (an already ended or expired session is fine)."""
        try:
            self._client._request("DELETE", f"/sessions/{self.id}", headers=self._client._infer_headers())
        except NotFoundError:
            pass

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSession:
    """One session of an AsyncGangServeClient (`await client.session()`); as Session, awaited."""

    def __init__(self, client: AsyncSessionCalls, info: dict[str, Any],
                 prefill_output: np.ndarray | None = None) -> None:
        self._client = client
        self.id: str = str(info["session_id"])
        self.info: dict[str, Any] = info
        self.prefill_output = prefill_output

    length = Session.length
    weights_version = Session.weights_version
    replayed = Session.replayed

    async def append(self, rows: np.ndarray, fmt: str = "safetensors", *,
                     deadline_s: float | None = None) -> np.ndarray:
        """As Session.append."""
        reply = await self._client._session_request(f"/sessions/{self.id}/append", rows, fmt, deadline_s,
                                                    params={"length": str(self.length)}, key=new_key())
        self.info = session_info(reply, self.info)
        return decode_reply(reply)

    async def refresh(self) -> dict[str, Any]:
        """As Session.refresh."""
        reply = await self._client._request("GET", f"/sessions/{self.id}", headers=self._client._infer_headers())
        self.info = reply.json()
        return self.info

    async def close(self) -> None:
        """As Session.close."""
        try:
            await self._client._request("DELETE", f"/sessions/{self.id}", headers=self._client._infer_headers())
        except NotFoundError:
            pass

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
