"""Python client and CLI for gangserve (`python -m clients --help`)."""
from clients.client import (
    AsyncGangServeClient,
    BadRequestError,
    GangServeClient,
    GangServeHTTPError,
    InvalidInputError,
    UnavailableError,
)

__all__ = [
    "AsyncGangServeClient",
    "BadRequestError",
    "GangServeClient",
    "GangServeHTTPError",
    "InvalidInputError",
    "UnavailableError",
]
