"""Python clients for the gangserve HTTP API: `GangServeClient` (sync) and `AsyncGangServeClient`.

Both speak every /infer wire format (safetensors, npy, JSON) with the server's own codecs
(`service.codecs`), keep the array's dtype on the wire (float32, float16, bfloat16 as
`ml_dtypes.bfloat16`, float64), retry 503/429 replies that carry `Retry-After` a bounded
number of times, and raise a typed `GangServeHTTPError` subclass carrying the server's
`{"error", "code"}`. For the Open Inference Protocol v2 routes use a stock client
(`tritonclient.http`), which works against /v2 unchanged.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import numpy as np

from service import codecs

FORMATS = {
    "safetensors": codecs.SAFETENSORS,
    "npy": codecs.NPY,
    "json": codecs.JSON,
}
RETRY_STATUSES = (429, 503)
MAX_RETRY_SLEEP_S = 10.0


class GangServeHTTPError(RuntimeError):
    """A non-2xx reply; carries the server's {"error", "code"}, the status and Retry-After."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s


class BadRequestError(GangServeHTTPError):
    """400: the body could not be parsed."""


class AuthError(GangServeHTTPError):
    """401: missing or bad bearer token."""


class NotFoundError(GangServeHTTPError):
    """404."""


class NotAcceptableError(GangServeHTTPError):
    """406: Accept names no format the server writes."""


class ConflictError(GangServeHTTPError):
    """409: valid, but does not fit the current state."""


class PayloadTooLargeError(GangServeHTTPError):
    """413: body over the server's max_body_bytes."""


class UnsupportedMediaTypeError(GangServeHTTPError):
    """415: Content-Type (or Content-Encoding) not supported."""


class InvalidInputError(GangServeHTTPError):
    """422: wrong shape, dtype, name, non-finite values, or over the server's limits."""


class UnavailableError(GangServeHTTPError):
    """429/503: overloaded or the gang is not ready (retried while Retry-After allows)."""


class GatewayTimeoutError(GangServeHTTPError):
    """504: the gang did not answer within the deadline."""


_ERRORS: dict[int, type[GangServeHTTPError]] = {
    400: BadRequestError, 401: AuthError, 404: NotFoundError, 406: NotAcceptableError, 409: ConflictError,
    413: PayloadTooLargeError, 415: UnsupportedMediaTypeError, 422: InvalidInputError, 429: UnavailableError,
    503: UnavailableError, 504: GatewayTimeoutError,
}


def error_of(reply: httpx.Response) -> GangServeHTTPError:
    """The typed error for a non-2xx reply, with the server's message and code."""
    try:
        doc = reply.json()
        message, code = str(doc.get("error", reply.text)), str(doc.get("code", "unknown"))
    except (ValueError, AttributeError):
        message, code = reply.text, "unknown"
    retry_after = reply.headers.get("retry-after")
    try:
        retry_after_s = float(retry_after) if retry_after else None
    except ValueError:  # an HTTP date: not used by gangserve; retry after a second
        retry_after_s = 1.0
    cls = _ERRORS.get(reply.status_code, GangServeHTTPError)
    return cls(reply.status_code, code, message, retry_after_s)


def encode_request(x: np.ndarray, fmt: str) -> tuple[bytes, str]:
    """(body, Content-Type) of an /infer request holding `x` as `hidden_states`."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")
    x = np.asarray(x)
    if fmt == "safetensors":
        return codecs.encode_safetensors({codecs.INPUT_NAME: x}), FORMATS[fmt]
    if fmt == "npy":
        if x.dtype == codecs.BFLOAT16:
            raise ValueError("npy cannot carry bfloat16; use fmt='safetensors' or fmt='json'")
        return codecs.encode_npy(x), FORMATS[fmt]
    return codecs.encode_json(x, name=codecs.INPUT_NAME), FORMATS[fmt]


def decode_reply(reply: httpx.Response) -> np.ndarray:
    """The `output` tensor of a 200 /infer reply, in the reply's dtype."""
    media = reply.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == codecs.SAFETENSORS:
        return codecs.decode_safetensors(reply.content, name=codecs.OUTPUT_NAME)
    if media == codecs.NPY:
        return codecs.decode_npy(reply.content)
    doc = reply.json()
    dtype = codecs.FLOAT_DTYPES[doc["dtype"]]
    return codecs.numbers_to_array(doc[codecs.OUTPUT_NAME], dtype, what="output").reshape(doc["shape"])


def _infer_args(x: np.ndarray, fmt: str, output_dtype: str | None, accept: str | None) -> dict[str, Any]:
    body, media = encode_request(x, fmt)
    headers = {"content-type": media}
    if accept is not None:
        headers["accept"] = FORMATS.get(accept, accept)
    params = {"output_dtype": output_dtype} if output_dtype else None
    return {"content": body, "headers": headers, "params": params}


def _retry_sleep_s(error: GangServeHTTPError, attempt: int, retries: int) -> float | None:
    """Seconds to wait before retrying `error`, or None to raise it."""
    if error.status not in RETRY_STATUSES or error.retry_after_s is None or attempt >= retries:
        return None
    return min(error.retry_after_s, MAX_RETRY_SLEEP_S)


class GangServeClient:
    """Sync client: `with GangServeClient("http://127.0.0.1:8000") as c: y = c.infer(x)`."""

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

    def infer(self, x: np.ndarray, fmt: str = "safetensors", *, output_dtype: str | None = None,
              accept: str | None = None) -> np.ndarray:
        """Self-attention of x [batch, seq, E] or [seq, E].

        fmt: request format (safetensors | npy | json); accept: reply format (default: fmt);
        output_dtype: float32 | float16 | bfloat16 | float64 (default: x's dtype).
        """
        reply = self._request("POST", "/infer", **_infer_args(x, fmt, output_dtype, accept))
        return decode_reply(reply)

    def gang(self) -> dict[str, Any]:
        return self._request("GET", "/gang").json()

    def ready(self) -> bool:
        return self._http.get("/readyz").status_code == 200

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One call; 503/429 with Retry-After is retried up to `retries` times."""
        attempt = 0
        while True:
            reply = self._http.request(method, path, **kwargs)
            if reply.is_success:
                return reply
            error = error_of(reply)
            sleep_s = _retry_sleep_s(error, attempt, self._retries)
            if sleep_s is None:
                raise error
            time.sleep(sleep_s)
            attempt += 1


class AsyncGangServeClient:
    """Async client: `async with AsyncGangServeClient(url) as c: y = await c.infer(x)`."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, timeout_s: float = 120.0,
                 retries: int = 3) -> None:
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s)
        self._retries = retries

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncGangServeClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def infer(self, x: np.ndarray, fmt: str = "safetensors", *, output_dtype: str | None = None,
                    accept: str | None = None) -> np.ndarray:
        """As GangServeClient.infer."""
        reply = await self._request("POST", "/infer", **_infer_args(x, fmt, output_dtype, accept))
        return decode_reply(reply)

    async def gang(self) -> dict[str, Any]:
        return (await self._request("GET", "/gang")).json()

    async def ready(self) -> bool:
        return (await self._http.get("/readyz")).status_code == 200

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        attempt = 0
        while True:
            reply = await self._http.request(method, path, **kwargs)
            if reply.is_success:
                return reply
            error = error_of(reply)
            sleep_s = _retry_sleep_s(error, attempt, self._retries)
            if sleep_s is None:
                raise error
            await asyncio.sleep(sleep_s)
            attempt += 1
