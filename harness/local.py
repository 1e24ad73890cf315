"""The local deployment (deployments/local.yaml) as tests and benchmarks start it."""
from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


# Ports handed out ahead of their server's bind come from below the kernel's ephemeral range
# (ip_local_port_range, 32768-60999 by default) and above Ray's worker ports (10002-19999):
# a port the kernel chose free (bind to 0) is from the ephemeral range, which every outgoing
# connection and every Ray process binding port 0 draws from in the seconds before the server
# binds it (seen: HAProxy's stats port taken while Ray started, "Address already in use").
PRESET_PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on every address a moment ago, from PRESET_PORTS (never one this process
    handed out before), for a server started later on it."""
    start = random.randrange(len(PRESET_PORTS))
    for i in range(len(PRESET_PORTS)):
        port = PRESET_PORTS[(start + i) % len(PRESET_PORTS)]
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free TCP port in {PRESET_PORTS.start}-{PRESET_PORTS.stop - 1} (all bound or handed out)")


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
