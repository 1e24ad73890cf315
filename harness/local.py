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
