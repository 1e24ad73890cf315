"""Python client and CLI for gangserve (`python -m clients --help`)."""
from clients.client import GangServeClient, GangServeHTTPError

__all__ = ["GangServeClient", "GangServeHTTPError"]
