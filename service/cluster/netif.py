"""Which network interface a process group binds to: the one that carries the node's Ray IP.

gloo and NCCL pick their interface from the hostname when `GLOO_SOCKET_IFNAME` /
`NCCL_SOCKET_IFNAME` are unset. On Debian/Ubuntu the hostname resolves to a loopback
address (127.0.1.1, or 127.0.0.1 here), so each rank advertises loopback to its peers and
every cross-node connection is refused (`Gloo connectFullMesh failed ... remote=[127.0.0.1]`).
Ray already knows the address other nodes reach this node at (`--node-ip-address`, the
address the raylet registered), so we bind to the interface holding that address.

A value the user set in the environment always wins; we only fill in what is unset (and
what we set ourselves earlier in the same process, e.g. before a rebuild). A user who set
only one of the two gets it mirrored into the other (see `mirrored_value`).
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from dataclasses import dataclass

log = logging.getLogger("gangserve.netif")

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address
_set_by_us: dict[str, str] = {}


@dataclass(frozen=True)
class InterfaceChoice:
    """The interface this process's collectives use, and why."""

    iface: str | None  # None: left to gloo/NCCL's own choice
    how: str  # "user" (set in the environment), "node_ip", or "unknown: <why>"


def ipv4_interfaces() -> dict[str, str]:
    """{interface name: IPv4 address} for every local interface that has one."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_for(ip: str) -> str | None:
    """The local interface holding `ip`, or None."""
    for name, address in ipv4_interfaces().items():
        if address == ip:
            return name
    return None


def bind_collectives_to(node_ip: str) -> InterfaceChoice:
    """Point gloo and NCCL at the interface that carries `node_ip` (unless the user chose).

    Must run in the process that creates the process group, before it does.
    """
    user = {v: os.environ[v] for v in SOCKET_IFNAME_VARS if os.environ.get(v) and _set_by_us.get(v) != os.environ[v]}
    if "GLOO_SOCKET_IFNAME" in user or "NCCL_SOCKET_IFNAME" in user:
        iface = user.get("GLOO_SOCKET_IFNAME") or user.get("NCCL_SOCKET_IFNAME")
        mirrored = _mirror_half_set(user)
        log.info("collectives bind to %s (set by the user: %s%s)", iface, ", ".join(f"{k}={v}" for k, v in user.items()),
                 f"; mirrored {mirrored}" if mirrored else "")
        return InterfaceChoice(iface, "user")
    try:
        iface = interface_for(node_ip)
    except OSError as exc:
        return InterfaceChoice(None, f"unknown: cannot list interfaces ({exc.strerror or exc})")
    if iface is None:
        log.warning("no local interface holds the node IP %s; gloo/NCCL choose their own", node_ip)
        return InterfaceChoice(None, f"unknown: no interface holds {node_ip}")
    for var in SOCKET_IFNAME_VARS:
        os.environ[var] = iface
        _set_by_us[var] = iface
    log.info("collectives bind to %s (the interface of node IP %s)", iface, node_ip)
    return InterfaceChoice(iface, "node_ip")


def mirrored_value(var: str, value: str) -> str | None:
    """The value for `var` that names the interfaces the user gave the other variable, or
    None when it cannot be said in `var`'s syntax.

    gloo takes exact names, comma-separated (`eth0,eth1`); NCCL takes prefixes, with `=`
    for exact names and `^` to exclude. So gloo's `eth0` is NCCL's `=eth0` (not every
    interface starting with eth0), NCCL's `=eth0` or `eth0` is gloo's `eth0`, and an
    exclusion list (`^docker`) has no gloo equivalent."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        return None
    if var == "NCCL_SOCKET_IFNAME":  # from gloo's exact names
        return "=" + ",".join(names)
    if value.startswith("^"):  # NCCL's exclusion: gloo cannot say it
        return None
    return ",".join(n.lstrip("=") for n in names)


def _mirror_half_set(user: dict[str, str]) -> str:
    """When the user set only one of the two variables, give the other the same
    interfaces: gloo and NCCL each fall back to their own guess otherwise (lo, docker0),
    and the data group and the control group would leave on different networks."""
    if len(user) != 1:
        return ""
    (given, value), = user.items()
    other = next(v for v in SOCKET_IFNAME_VARS if v != given)
    mirror = mirrored_value(other, value)
    if mirror is None:
        log.warning("%s=%s has no %s equivalent; %s is left to its own choice", given, value, other, other)
        return ""
    os.environ[other] = mirror
    _set_by_us[other] = mirror
    return f"{other}={mirror}"


def bind_ray_worker() -> InterfaceChoice:
    """Bind this Ray worker process's collectives to its own node's interface (run it in
    each worker before the process group exists, e.g. a training run's DDP rank actors)."""
    import ray

    return bind_collectives_to(ray.util.get_node_ip_address())


def node_ip() -> str:
    """The address other nodes reach this node at: the IP its raylet registered with Ray
    (`--node-ip-address`), never a loopback guess from the hostname (see the module
    docstring). What a listener other nodes must reach binds to (the direct data plane)."""
    import ray

    return ray.util.get_node_ip_address()
