"""Inference clients for the gangserve HTTP API: `GangServeClient` (sync) and `AsyncGangServeClient`.

Both speak every /infer wire format (safetensors, npy, JSON) with the codecs the service
itself uses (`gangserve_client.codecs`), keep the array's dtype on the wire (float32,
float16, bfloat16 as `ml_dtypes.bfloat16`, float64), retry as `gangserve_client.retries`
says, and raise typed errors (`gangserve_client.errors`). Tokens come from where the
service takes them (`gangserve_client.tokens`): inference sends the inference token
(`infer_token=`, else $GANGSERVE_INFER_TOKEN), else the API token if one is known (the
service accepts it on inference too); `gang()` sends the API token, which shows the full
description. For the Open Inference Protocol v2 routes use a stock client
(`tritonclient.http`), which works against /v2 unchanged.

Direct mode (`direct=True`, CLI `--direct`; the service must run with `direct_data_plane:
true`): `infer` goes to the gang servers' own HTTP ports instead of the ingress, one
process hop less. The client reads the `data_url` of every serving gang from `GET /gangs`
(again every `DIRECT_REFRESH_S`, and after any failure), spreads its requests over them
round robin, and sends a request through the ingress instead when no gang advertises one,
when the direct URL cannot be reached (connection refused or reset, connect timeout
`direct_connect_timeout_s`) or when it answers 503 (its gang is rebuilding: the ingress waits
for it, or picks another gang); after such a failure it keeps to the ingress for
`DIRECT_RETRY_AFTER_S`. One direct attempt per request at most, so a request never waits
on a direct URL for longer than the connect timeout before the ingress takes it.
`direct_stats` counts the requests each way.
"""
from __future__ import annotations

from typing import Any

import itertools
import time

import httpx
import numpy as np
import orjson

from gangserve_client import codecs, tokens
from gangserve_client.errors import GangServeHTTPError, ServiceUnreachableError, error_of
from gangserve_client.retries import RetryPolicy, asend, send

FORMATS = {
    "safetensors": codecs.SAFETENSORS,
    "npy": codecs.NPY,
    "json": codecs.JSON,
}
DEFAULT_URL = "http://127.0.0.1:8000"
DEADLINE_HEADER = "X-Request-Timeout-Seconds"  # the service's (and Ray Serve's proxy's) deadline header
DIRECT_REFRESH_S = 10.0  # direct mode: how long the gangs' data URLs are used before /gangs is read again
DIRECT_RETRY_AFTER_S = 5.0  # direct mode: after a direct URL failed, requests take the ingress this long
DIRECT_CONNECT_TIMEOUT_S = 2.0  # direct mode: a data URL that does not accept by then is given up on


def encode_request(x: np.ndarray, fmt: str, attention_mask: np.ndarray | None = None) -> tuple[bytes, str]:
    """(body, Content-Type) of an /infer request holding `x` as `hidden_states` and, if given,
    `attention_mask` ([batch, seq] or [seq]; 1 = token, 0 = padding; not in npy)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")
    x = np.asarray(x)
    mask = None if attention_mask is None else np.asarray(attention_mask)
    if mask is not None and mask.dtype.kind not in "biu":
        raise ValueError(f"attention_mask must be an integer or boolean array of 0/1; got dtype {mask.dtype}")
    if fmt == "safetensors":
        tensors = {codecs.INPUT_NAME: x}
        if mask is not None:
            tensors[codecs.MASK_NAME] = mask if mask.dtype.name in ("bool", "uint8", "int32", "int64") else mask.astype(np.int64)
        return codecs.encode_safetensors(tensors), FORMATS[fmt]
    if fmt == "npy":
        if codecs.is_bfloat16(x.dtype):
            raise ValueError("npy cannot carry bfloat16; use fmt='safetensors' or fmt='json'")
        if mask is not None:
            raise ValueError("npy bodies carry one array, so no attention_mask; use fmt='safetensors' or fmt='json'")
        return codecs.encode_npy(x), FORMATS[fmt]
    body = codecs.encode_json(x, name=codecs.INPUT_NAME)
    if mask is not None:  # one more key in the same object
        body = body[:-1] + b',"' + codecs.MASK_NAME.encode() + b'":' + orjson.dumps(mask.astype(np.int64).tolist()) + b"}"
    return body, FORMATS[fmt]


def decode_reply(reply: httpx.Response) -> np.ndarray:
    """The `output` tensor of a 200 /infer reply, in the reply's dtype."""
    media = reply.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == codecs.SAFETENSORS:
        return codecs.decode_safetensors(reply.content, name=codecs.OUTPUT_NAME)
    if media == codecs.NPY:
        return codecs.decode_npy(reply.content)
    return codecs.decode_json(reply.content, name=codecs.OUTPUT_NAME)


def _known_api_token(token: str | None) -> str | None:
    if token:
        return token
    try:
        found = tokens.api_token()
    except OSError:  # an unreadable token file: inference may not need it
        return None
    return found.value if found else None


def _bearer(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


class _DirectRoutes:
    """Direct mode's view of the gangs' data URLs: which to use next, when to re-read them."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self._cycle: Any = iter(())
        self._read_at = float("-inf")
        self._retry_at = float("-inf")
        self.stats = {"direct": 0, "ingress": 0, "fallbacks": 0}

    def stale(self) -> bool:
        return time.monotonic() >= self._read_at + DIRECT_REFRESH_S and time.monotonic() >= self._retry_at

    def update(self, view: dict[str, Any] | None) -> None:
        """From a /gangs body (None: it could not be read): the data URLs of the serving gangs."""
        rows = (view or {}).get("gangs") or []
        self.urls = sorted({g["data_url"] for g in rows if g.get("state") == "ready" and g.get("data_url")})
        self._cycle = itertools.cycle(self.urls)
        self._read_at = time.monotonic()

    def pick(self) -> str | None:
        """The next data URL, or None: use the ingress (none advertised, or a recent failure)."""
        if not self.urls or time.monotonic() < self._retry_at:
            return None
        return next(self._cycle)

    def failed(self) -> None:
        """A direct attempt failed: the ingress for a while, then /gangs again."""
        self.stats["fallbacks"] += 1
        self._retry_at = time.monotonic() + DIRECT_RETRY_AFTER_S
        self._read_at = float("-inf")

    def settle(self, reply: httpx.Response | None, exc: httpx.TransportError | None) -> httpx.Response | None:
        """A direct attempt's outcome (its reply, or the transport error it raised): the 2xx
        reply; None when the request goes to the ingress instead (`_direct_fallback`);
        otherwise the typed error is raised (a 4xx stays the caller's answer)."""
        error: Exception | None = exc if reply is None else (None if reply.is_success else error_of(reply))
        if error is None:
            self.stats["direct"] += 1
            return reply
        if not _direct_fallback(error):
            raise error
        self.failed()
        return None


def _direct_fallback(exc: Exception) -> bool:
    """Whether a direct attempt's failure sends the request to the ingress: the URL cannot be
    reached or dropped the connection (inference is idempotent), or the gang cannot serve now
    (503: rebuilding or broken; the ingress waits for it or picks another gang)."""
    if isinstance(exc, httpx.TransportError):
        return not isinstance(exc, httpx.ReadTimeout)  # a slow gang stays slow through the ingress
    return isinstance(exc, GangServeHTTPError) and exc.status == 503


class _Base:
    def __init__(self, token: str | None, infer_token: str | None, retries: int,
                 retry_timeout_s: float | None, direct: bool = False) -> None:
        self._api_token = _known_api_token(token)
        self._infer_token = infer_token or tokens.infer_token() or token
        self._policy = RetryPolicy(retries=retries, timeout_s=retry_timeout_s)
        self._direct = _DirectRoutes() if direct else None

    @property
    def direct_stats(self) -> dict[str, int]:
        """Direct mode: requests sent to a data URL, through the ingress, and direct attempts
        that fell back to the ingress (all 0 without direct mode)."""
        return dict(self._direct.stats) if self._direct else {"direct": 0, "ingress": 0, "fallbacks": 0}

    def _infer_args(self, x: np.ndarray, fmt: str, output_dtype: str | None, accept: str | None,
                    attention_mask: np.ndarray | None = None, causal: bool | None = None,
                    deadline_s: float | None = None) -> dict[str, Any]:
        body, media = encode_request(x, fmt, attention_mask)
        headers = {"content-type": media, **_bearer(self._infer_token)}
        extra: dict[str, Any] = {}
        if deadline_s is not None:
            if not deadline_s > 0:
                raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
            # The service answers 504 deadline_exceeded at the deadline; the HTTP wait ends a
            # second later, so that answer (not a client-side timeout) is what the caller sees.
            headers[DEADLINE_HEADER] = f"{deadline_s:.6g}"
            extra["timeout"] = deadline_s + 1.0
        if accept is not None:
            headers["accept"] = FORMATS.get(accept, accept)
        params: dict[str, str] = {"output_dtype": output_dtype} if output_dtype else {}
        if causal is not None:
            params["causal"] = "true" if causal else "false"
        return {"content": body, "headers": headers, "params": params or None, **extra}


class GangServeClient(_Base):
    """Sync client: `with GangServeClient("http://127.0.0.1:8000") as c: y = c.infer(x)`.

    token: the API token (default: $GANGSERVE_API_TOKEN, else $GANGSERVE_STATE_DIR/api_token);
    infer_token: the inference token (default: $GANGSERVE_INFER_TOKEN, else `token`);
    timeout_s: per HTTP request; retries / retry_timeout_s: see `RetryPolicy`.
    """

    def __init__(self, base_url: str = DEFAULT_URL, *, token: str | None = None, infer_token: str | None = None,
                 timeout_s: float = 120.0, retries: int = 3, retry_timeout_s: float | None = 60.0,
                 direct: bool = False, direct_connect_timeout_s: float = DIRECT_CONNECT_TIMEOUT_S) -> None:
        super().__init__(token, infer_token, retries, retry_timeout_s, direct)
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s)
        self._data = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=direct_connect_timeout_s)) if direct else None

    def close(self) -> None:
        self._http.close()
        if self._data is not None:
            self._data.close()

    def __enter__(self) -> "GangServeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def infer(self, x: np.ndarray, fmt: str = "safetensors", *, output_dtype: str | None = None,
              accept: str | None = None, attention_mask: np.ndarray | None = None,
              causal: bool | None = None, deadline_s: float | None = None) -> np.ndarray:
        """Self-attention of x [batch, seq, E] or [seq, E].

        fmt: request format (safetensors | npy | json); accept: reply format (default: fmt);
        output_dtype: float32 | float16 | bfloat16 | float64 (default: x's dtype);
        attention_mask: [batch, seq] (or [seq]) of 1 = token, 0 = padding (safetensors, json);
        causal: causal attention (default: the served model's);
        deadline_s: the request's deadline (header X-Request-Timeout-Seconds; default: the
        service's request_timeout_s): the service answers 504 `deadline_exceeded`
        (GatewayTimeoutError) once it passes and never computes the request afterwards. Each
        retry attempt carries the full deadline; retry_timeout_s bounds them all together.
        """
        args = self._infer_args(x, fmt, output_dtype, accept, attention_mask, causal, deadline_s)
        if self._direct is not None:
            reply = self._infer_direct(args)
            if reply is not None:
                return decode_reply(reply)
            self._direct.stats["ingress"] += 1
        return decode_reply(self._request("POST", "/infer", **args))

    def _infer_direct(self, args: dict[str, Any]) -> httpx.Response | None:
        """Direct mode: the 200 reply of one attempt at a gang's data URL, or None (the
        ingress takes the request); any other error reply is raised as the ingress's would be."""
        routes = self._direct
        assert routes is not None and self._data is not None
        if routes.stale():
            try:
                routes.update(self.gangs())
            except (GangServeHTTPError, ServiceUnreachableError):
                routes.update(None)  # the ingress answers this request, or says why not
        url = routes.pick()
        if url is None:
            return None
        try:
            reply = self._data.post(url + "/infer", **args)
        except httpx.TransportError as exc:
            return routes.settle(None, exc)
        return routes.settle(reply, None)

    def gang(self) -> dict[str, Any]:
        """GET /gang (file-system paths in it only with the API token)."""
        return self._request("GET", "/gang", headers=_bearer(self._api_token)).json()

    def gangs(self) -> dict[str, Any]:
        """GET /gangs: every gang of the app (with `data_url` where a gang serves directly)."""
        return self._request("GET", "/gangs", headers=_bearer(self._api_token)).json()

    def ready(self) -> bool:
        """GET /readyz once: True when the gang can serve."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.TransportError as exc:
            raise ServiceUnreachableError(f"GET {self._http.base_url}readyz: {type(exc).__name__}: {exc}") from exc

    def _request(self, method: str, path: str, *, idempotent: bool = True, **kwargs: Any) -> httpx.Response:
        """One call with this client's retry policy: the 2xx reply, or the typed error."""
        return send(self._http, self._policy, method, path, idempotent=idempotent, **kwargs)


class AsyncGangServeClient(_Base):
    """Async client: `async with AsyncGangServeClient(url) as c: y = await c.infer(x)`; arguments as
    GangServeClient's."""

    def __init__(self, base_url: str = DEFAULT_URL, *, token: str | None = None, infer_token: str | None = None,
                 timeout_s: float = 120.0, retries: int = 3, retry_timeout_s: float | None = 60.0,
                 direct: bool = False, direct_connect_timeout_s: float = DIRECT_CONNECT_TIMEOUT_S) -> None:
        super().__init__(token, infer_token, retries, retry_timeout_s, direct)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s)
        self._data = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=direct_connect_timeout_s)) \
            if direct else None

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._data is not None:
            await self._data.aclose()

    async def __aenter__(self) -> "AsyncGangServeClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def infer(self, x: np.ndarray, fmt: str = "safetensors", *, output_dtype: str | None = None,
                    accept: str | None = None, attention_mask: np.ndarray | None = None,
                    causal: bool | None = None, deadline_s: float | None = None) -> np.ndarray:
        """As GangServeClient.infer."""
        args = self._infer_args(x, fmt, output_dtype, accept, attention_mask, causal, deadline_s)
        if self._direct is not None:
            reply = await self._infer_direct(args)
            if reply is not None:
                return decode_reply(reply)
            self._direct.stats["ingress"] += 1
        return decode_reply(await self._request("POST", "/infer", **args))

    async def _infer_direct(self, args: dict[str, Any]) -> httpx.Response | None:
        """As GangServeClient._infer_direct."""
        routes = self._direct
        assert routes is not None and self._data is not None
        if routes.stale():
            try:
                routes.update(await self.gangs())
            except (GangServeHTTPError, ServiceUnreachableError):
                routes.update(None)
        url = routes.pick()
        if url is None:
            return None
        try:
            reply = await self._data.post(url + "/infer", **args)
        except httpx.TransportError as exc:
            return routes.settle(None, exc)
        return routes.settle(reply, None)

    async def gang(self) -> dict[str, Any]:
        return (await self._request("GET", "/gang", headers=_bearer(self._api_token))).json()

    async def gangs(self) -> dict[str, Any]:
        """As GangServeClient.gangs."""
        return (await self._request("GET", "/gangs", headers=_bearer(self._api_token))).json()

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/readyz")).status_code == 200
        except httpx.TransportError as exc:
            raise ServiceUnreachableError(f"GET {self._http.base_url}readyz: {type(exc).__name__}: {exc}") from exc

    async def _request(self, method: str, path: str, *, idempotent: bool = True, **kwargs: Any) -> httpx.Response:
        """As GangServeClient._request."""
        return await asend(self._http, self._policy, method, path, idempotent=idempotent, **kwargs)
