"""Request deadlines: where a request's deadline comes from and how it travels.

Every inference request has a deadline, fixed when the ingress starts handling it:

    X-Request-Timeout-Seconds: <float seconds>      (the header Ray Serve's proxy reads too)
    OIP v2 `parameters.timeout`: <integer microseconds, as Triton>
    else the builder's `request_timeout_s` (AppConfig; 120 s by default)

(the header and the OIP parameter both given: the earlier deadline wins). A value that is
not a finite number > 0 (and at most MAX_TIMEOUT_S) is refused with 422 `invalid_deadline`.

Inside a process the deadline is a `time.monotonic()` instant. Between processes (the
handle call to the GangServer, the data channel) it travels as the seconds left, and the
receiver turns it back into its own monotonic instant: no clock is compared across
processes or nodes; the hop's own latency (well under a millisecond to a few ms) is the
only error, and it errs on the late side by that much at most.

Behind the front door (service.cluster.front_door: Serve's HAProxy straight to the ingress
replicas) the ingress alone times the header: it switches Serve's own timer off in its
process (`own_header_deadlines`), and the deadline is exactly what the header says. Without
the front door, Serve's Python proxy answers **408 in plain text** when the header's time is
up (it starts its timer when it receives the request, a little before the ingress sees it).
So that the client gets our JSON 504 `deadline_exceeded` instead, a deadline from the header
is then set `proxy_margin_s(header)` earlier than the header says: the tunables
`ingress.proxy_margin_s` plus `proxy_margin_share` of the header, at most
`proxy_margin_max_s` (docs/tunables.md; the proxy-to-ingress hop grows under load, and
longer deadlines can spare more); the other two sources do not arm the proxy's timer and
get no margin.
"""
from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Awaitable, Callable, TypeVar

from service.cluster.front_door import header_timed_by_serve_proxy
from service.contract.errors import ErrorCode, InvalidInput
from service.config.tunables import IngressTunables

T = TypeVar("T")

HEADER = "x-request-timeout-seconds"
MAX_TIMEOUT_S = 86400.0
# Read once: the environment Ray started this process with (service.cluster.front_door).
BEHIND_SERVE_PROXY = header_timed_by_serve_proxy()


def proxy_margin_s(header_s: float, behind_serve_proxy: bool | None = None,
                   tunables: IngressTunables | None = None) -> float:
    """How much earlier than a header deadline of `header_s` seconds we answer: 0 behind the
    front door; the margin when Serve's Python proxy times the header too (`behind_serve_proxy`,
    default: this process's environment says so), from the ingress tunables' proxy_margin_*
    (default: their defaults). Answering that much before Serve's proxy answers 408."""
    if behind_serve_proxy is None:
        behind_serve_proxy = BEHIND_SERVE_PROXY
    if not behind_serve_proxy:
        return 0.0
    t = tunables or IngressTunables()
    return min(t.proxy_margin_max_s, t.proxy_margin_s + t.proxy_margin_share * header_s)


def _timeout(value: float, what: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise InvalidInput(f"{what} must be a finite number of seconds > 0, got {value!r:.40}",
                           code=ErrorCode.INVALID_DEADLINE)
    if value > MAX_TIMEOUT_S:
        raise InvalidInput(f"{what} is {value:g}s; at most {MAX_TIMEOUT_S:g}s", code=ErrorCode.INVALID_DEADLINE)
    return value


def header_timeout(value: str | None) -> float | None:
    """X-Request-Timeout-Seconds as seconds (None: absent); 422 when not a number > 0."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        raise InvalidInput(f"X-Request-Timeout-Seconds must be a number of seconds, got {value!r:.40}",
                           code=ErrorCode.INVALID_DEADLINE) from None
    return _timeout(seconds, "X-Request-Timeout-Seconds")


def oip_timeout(parameters: dict[str, Any] | None) -> float | None:
    """OIP `parameters.timeout` (microseconds, as Triton) as seconds (None: absent); 422 when
    not a number > 0."""
    value = (parameters or {}).get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput(f"parameters.timeout must be a number of microseconds, got {value!r:.40}",
                           code=ErrorCode.INVALID_DEADLINE)
    if not (math.isfinite(value) and value > 0):
        _timeout(float(value), "parameters.timeout (microseconds)")  # raises: not > 0
    return _timeout(float(value) / 1e6, "parameters.timeout / 1e6")


def request_deadline(started: float, default_s: float, header_s: float | None,
                     oip_s: float | None = None, behind_serve_proxy: bool | None = None,
                     tunables: IngressTunables | None = None) -> float:
    """The monotonic instant a request started at `started` must be answered by
    (`behind_serve_proxy`, `tunables`: as proxy_margin_s)."""
    candidates = [started + default_s] if header_s is None and oip_s is None else []
    if header_s is not None:
        candidates.append(started + max(0.0, header_s - proxy_margin_s(header_s, behind_serve_proxy, tunables)))
    if oip_s is not None:
        candidates.append(started + oip_s)
    return min(candidates)


def seconds_left(deadline: float | None) -> float | None:
    """What travels to another process: the seconds left (None: no deadline)."""
    return None if deadline is None else deadline - time.monotonic()


def local_deadline(seconds: float | None) -> float | None:
    """The inverse of seconds_left, in the receiving process."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        raise ValueError(f"a deadline must be a number of seconds, got {seconds!r:.40}")
    return time.monotonic() + float(seconds)


async def bounded(call: Awaitable[T], *, until: float, timed_out: Callable[[], BaseException],
                  on_cancel: Callable[[], object] | None = None,
                  check: Callable[[], Awaitable[None]] | None = None, check_every_s: float = math.inf) -> T:
    """The one bounded wait of the ingress: `call`'s result, or `timed_out()` raised at `until`
    (time.monotonic()). Every `check_every_s` meanwhile, `check()` may raise to give up early
    (the request policy: the gang was seen unable to answer). Giving up, or being cancelled,
    cancels the call (and calls `on_cancel`, e.g. a Serve response's `cancel`)."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            remaining = until - time.monotonic()
            if remaining <= 0:
                raise timed_out()
            done, _ = await asyncio.wait({task}, timeout=min(remaining, check_every_s))
            if done:
                return task.result()
            if check is not None:
                await check()
    finally:
        if not task.done():
            task.cancel()
            if on_cancel is not None:
                on_cancel()
            # A cancelled Serve response ends its task with RequestCancelledError rather than
            # CancelledError: nobody awaits it now, so read it (no "exception never retrieved").
            task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
