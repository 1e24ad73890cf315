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
"""
from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import orjson

from gangserve_client import codecs, tokens
from gangserve_client.errors import ServiceUnreachableError
from gangserve_client.replies import decode_reply, session_info
from gangserve_client.retries import RetryPolicy, asend, send
from gangserve_client.sessions import AsyncSession, Session

FORMATS = {
    "safetensors": codecs.SAFETENSORS,
    "npy": codecs.NPY,
    "json": codecs.JSON,
}
DEFAULT_URL = "http://127.0.0.1:8000"
DEADLINE_HEADER = "X-Request-Timeout-Seconds"  # the service's (and Ray Serve's proxy's) deadline header
IDEMPOTENCY_HEADER = "Idempotency-Key"  # a session append's key (the service's service.sessions.keys)


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


def _session_args(args: dict[str, Any], params: dict[str, str] | None, key: str | None) -> dict[str, Any]:
    """A session call's request arguments: its query parameters, and its idempotency key."""
    args["params"] = params
    if key is not None:
        args["headers"][IDEMPOTENCY_HEADER] = key
    return args


class _Base:
    def __init__(self, token: str | None, infer_token: str | None, retries: int,
                 retry_timeout_s: float | None) -> None:
        self._api_token = _known_api_token(token)
        self._infer_token = infer_token or tokens.infer_token() or token
        self._policy = RetryPolicy(retries=retries, timeout_s=retry_timeout_s)

    def _infer_headers(self) -> dict[str, str]:
        return _bearer(self._infer_token)

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
                 timeout_s: float = 120.0, retries: int = 3, retry_timeout_s: float | None = 60.0) -> None:
        super().__init__(token, infer_token, retries, retry_timeout_s)
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

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
        return decode_reply(self._request("POST", "/infer", **args))

    def session(self, prefill: np.ndarray | None = None, fmt: str = "safetensors", *,
                deadline_s: float | None = None) -> Session:
        """Open a stateful session (POST /sessions), with `prefill` [n, E] as its first rows
        (their outputs in `.prefill_output`); see gangserve_client.sessions."""
        if prefill is None:
            reply = self._request("POST", "/sessions", idempotent=False, headers=self._infer_headers())
            return Session(self, reply.json())
        reply = self._session_request("/sessions", prefill, fmt, deadline_s, idempotent=False)
        return Session(self, session_info(reply, {}), decode_reply(reply))

    def _session_request(self, path: str, rows: np.ndarray, fmt: str, deadline_s: float | None,
                         params: dict[str, str] | None = None, idempotent: bool = True,
                         key: str | None = None) -> httpx.Response:
        """POST `rows` to a session route; `key`: the append's idempotency key, sent on every
        attempt (so a timed-out attempt is retried too: gangserve_client.retries)."""
        args = _session_args(self._infer_args(rows, fmt, None, None, None, None, deadline_s), params, key)
        return self._request("POST", path, idempotent=idempotent, keyed=key is not None, **args)

    def gang(self) -> dict[str, Any]:
        """GET /gang (file-system paths in it only with the API token)."""
        return self._request("GET", "/gang", headers=_bearer(self._api_token)).json()

    def gangs(self) -> dict[str, Any]:
        """GET /gangs: every gang of the app."""
        return self._request("GET", "/gangs", headers=_bearer(self._api_token)).json()

    def ready(self) -> bool:
        """GET /readyz once: True when the gang can serve."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.TransportError as exc:
            raise ServiceUnreachableError(f"GET {self._http.base_url}readyz: {type(exc).__name__}: {exc}") from exc

    def _request(self, method: str, path: str, *, idempotent: bool = True, keyed: bool = False,
                 **kwargs: Any) -> httpx.Response:
        """One call with this client's retry policy: the 2xx reply, or the typed error."""
        return send(self._http, self._policy, method, path, idempotent=idempotent, keyed=keyed, **kwargs)


class AsyncGangServeClient(_Base):
    """Async client: `async with AsyncGangServeClient(url) as c: y = await c.infer(x)`; arguments as
    GangServeClient's."""

    def __init__(self, base_url: str = DEFAULT_URL, *, token: str | None = None, infer_token: str | None = None,
                 timeout_s: float = 120.0, retries: int = 3, retry_timeout_s: float | None = 60.0) -> None:
        super().__init__(token, infer_token, retries, retry_timeout_s)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncGangServeClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def infer(self, x: np.ndarray, fmt: str = "safetensors", *, output_dtype: str | None = None,
                    accept: str | None = None, attention_mask: np.ndarray | None = None,
                    causal: bool | None = None, deadline_s: float | None = None) -> np.ndarray:
        """As GangServeClient.infer."""
        args = self._infer_args(x, fmt, output_dtype, accept, attention_mask, causal, deadline_s)
        return decode_reply(await self._request("POST", "/infer", **args))

    async def session(self, prefill: np.ndarray | None = None, fmt: str = "safetensors", *,
                      deadline_s: float | None = None) -> AsyncSession:
        """As GangServeClient.session: `async with await client.session(x0) as s: await s.append(row)`."""
        if prefill is None:
            reply = await self._request("POST", "/sessions", idempotent=False, headers=self._infer_headers())
            return AsyncSession(self, reply.json())
        reply = await self._session_request("/sessions", prefill, fmt, deadline_s, idempotent=False)
        return AsyncSession(self, session_info(reply, {}), decode_reply(reply))

    async def _session_request(self, path: str, rows: np.ndarray, fmt: str, deadline_s: float | None,
                               params: dict[str, str] | None = None, idempotent: bool = True,
                               key: str | None = None) -> httpx.Response:
        """As GangServeClient._session_request."""
        args = _session_args(self._infer_args(rows, fmt, None, None, None, None, deadline_s), params, key)
        return await self._request("POST", path, idempotent=idempotent, keyed=key is not None, **args)

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

    async def _request(self, method: str, path: str, *, idempotent: bool = True, keyed: bool = False,
                       **kwargs: Any) -> httpx.Response:
        """As GangServeClient._request."""
        return await asend(self._http, self._policy, method, path, idempotent=idempotent, keyed=keyed, **kwargs)
