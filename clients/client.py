"""A small synchronous client for the gangserve HTTP API (httpx)."""
from __future__ import annotations

import io
import time
from typing import Any

import httpx
import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

FORMATS = {
    "safetensors": "application/x-safetensors",
    "npy": "application/x-npy",
    "json": "application/json",
}


class GangServeHTTPError(RuntimeError):
    """A non-2xx reply; carries the server's {"error", "code"} and the status."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s


class GangServeClient:
    """client = GangServeClient("http://127.0.0.1:8000"); y = client.infer(x)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, timeout_s: float = 120.0,
                 retries: int = 3) -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s)
        self._retries = retries

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "GangServeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def infer(self, x: np.ndarray, fmt: str = "safetensors") -> np.ndarray:
        """Self-attention of x [batch, seq, E] or [seq, E]; fmt = safetensors | npy | json."""
        media = FORMATS[fmt]
        if fmt == "safetensors":
            body = st_save({"hidden_states": np.ascontiguousarray(x)})
        elif fmt == "npy":
            buf = io.BytesIO()
            np.save(buf, x, allow_pickle=False)
            body = buf.getvalue()
        else:
            import json

            body = json.dumps({"hidden_states": np.asarray(x).tolist()}).encode()
        reply = self._request("POST", "/infer", content=body, headers={"content-type": media})
        if fmt == "safetensors":
            return st_load(reply.content)["output"]
        if fmt == "npy":
            return np.load(io.BytesIO(reply.content), allow_pickle=False)
        doc = reply.json()
        return np.asarray(doc["output"], dtype=doc["dtype"]).reshape(doc["shape"])

    def gang(self) -> dict[str, Any]:
        return self._request("GET", "/gang").json()

    def ready(self) -> bool:
        return self._http.get("/readyz").status_code == 200

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One call; 503 with Retry-After is retried up to `retries` times."""
        for attempt in range(self._retries + 1):
            reply = self._http.request(method, path, **kwargs)
            if reply.is_success:
                return reply
            error = _error_of(reply)
            if reply.status_code == 503 and attempt < self._retries:
                time.sleep(min(error.retry_after_s or 1.0, 10.0))
                continue
            raise error
        raise AssertionError("unreachable")


def _error_of(reply: httpx.Response) -> GangServeHTTPError:
    try:
        doc = reply.json()
        message, code = str(doc.get("error", reply.text)), str(doc.get("code", "unknown"))
    except ValueError:
        message, code = reply.text, "unknown"
    retry_after = reply.headers.get("retry-after")
    return GangServeHTTPError(reply.status_code, code, message, float(retry_after) if retry_after else None)
