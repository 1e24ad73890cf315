"""The local deployment (deployments/local.yaml) as tests and benchmarks start it."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_yaml_args() -> dict[str, Any]:
    """The `make serve` app's builder arguments (deployments/local.yaml)."""
    doc = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
    return dict(doc["applications"][0]["args"])



def front_door_env() -> dict[str, str]:
    """The product's front-door environment (service.cluster.front_door) plus what keeps one
    more Serve instance on this machine from colliding with another (a `make serve`, the
    bench, the suite): HAProxy's stats and metrics ports and the fallback proxy's ports
    chosen free instead of 8404, 9101, 8500 and 9500. (Serve already keeps HAProxy's files
    apart per node: /tmp/haproxy-serve/<node id>/; a longer base path would overflow a Unix
    socket's 108 bytes.) Set it before Ray starts."""
    from service.cluster.front_door import FRONT_DOOR_ENV

    return {
        **FRONT_DOOR_ENV,
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
    }
