"""Interface selection for the process groups (service.cluster.netif), on this machine's real interfaces."""
from __future__ import annotations

import pytest

from service.cluster import netif

pytestmark = pytest.mark.unit


def _unset_ifname_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset the interface variables for this test only. bind_collectives_to sets them in
    os.environ itself, so monkeypatch must know them first (a plain delenv of an unset
    variable records nothing, and the test's choice would leak into the session)."""
    for var in netif.SOCKET_IFNAME_VARS:
        monkeypatch.setenv(var, "unset-by-the-test")
        monkeypatch.delenv(var)


def test_loopback_address_maps_to_the_loopback_interface() -> None:
    interfaces = netif.ipv4_interfaces()
    assert interfaces.get("lo") == "127.0.0.1", interfaces
    assert netif.interface_for("127.0.0.1") == "lo"
    assert netif.interface_for("198.19.255.254") is None  # no interface holds it


def test_collectives_bind_to_the_node_ip_interface_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    _unset_ifname_vars(monkeypatch)
    choice = netif.bind_collectives_to("127.0.0.1")
    assert (choice.iface, choice.how) == ("lo", "node_ip")
    import os

    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    # What we set ourselves is recomputed on the next bring-up ...
    assert netif.bind_collectives_to("127.0.0.1").how == "node_ip"
    # ... but a value the user set wins.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    choice = netif.bind_collectives_to("127.0.0.1")
    assert (choice.iface, choice.how) == ("eth7", "user")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_an_address_no_interface_holds_leaves_the_choice_to_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    _unset_ifname_vars(monkeypatch)
    choice = netif.bind_collectives_to("198.19.255.254")
    assert choice.iface is None and choice.how.startswith("unknown: no interface holds")
