"""The environment variables the service reads, in one list (docs/environment.md).

Builder arguments (service.config.builder_args) and their `tunables:` section say how an app runs; the
environment says where its state lives and what its secrets are, things a process learns
before any builder argument reaches it (the launcher's checks, a training worker, a rank).
Each entry names the constant its module reads it through, so a renamed variable changes
here too; `python -m service.environment` prints the reference (`make docs`;
tests/test_config.py checks it is current).
"""
from __future__ import annotations

from dataclasses import dataclass

from gangserve_client import tokens
from service.cluster.front_door import FRONT_DOOR_ENV
from service.cluster.netif import SOCKET_IFNAME_VARS
from service.gang.failpoints import FAILPOINTS_ENV
from service.parallel.native import COMPILER_ENV, COMPILERS, KERNEL_DIR_ENV
from service.state.artifacts import ENDPOINT_ENVS, STORAGE_URL_ENV
from service.state.db import DATABASE_URL_ENV, JOURNAL_ENV
from service.state.paths import DEFAULT_STATE_DIR, STATE_DIR_ENV


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, the group it belongs to, who reads it, and what it does."""

    name: str
    group: str
    read_by: str
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable(STATE_DIR_ENV, "State", "service.state.paths",
             "The node's state directory: the SQLite database and local artifacts by default, the "
             "generated API token, the node's download cache. Default: "
             f"{DEFAULT_STATE_DIR} in the working directory of the process that starts Ray."),
    Variable(DATABASE_URL_ENV, "State", "service.state.db",
             "The state database: sqlite:///abs/path or postgresql://user:pass@host/db (the password "
             "is redacted in every message). Default: the SQLite file in the state directory."),
    Variable(JOURNAL_ENV, "State", "service.state.db",
             "Force SQLite's journal mode (wal or delete); default: WAL on a local file system, the "
             "rollback journal on a shared one."),
    Variable(STORAGE_URL_ENV, "Storage", "service.state.artifacts",
             "The artifact store (datasets, checkpoints, served weights copies): s3://bucket[/prefix] "
             "or an absolute path. Default: the state directory."),
    *(Variable(name, "Storage", "service.state.artifacts",
               "The S3 endpoint (http[s]://host[:port]) of an S3-compatible service; the first one set wins.")
      for name in ENDPOINT_ENVS),
    Variable("AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN", "Storage", "pyarrow's S3 client",
             "S3 credentials when the storage URL has none (redacted from messages)."),
    Variable("AWS_REGION / AWS_DEFAULT_REGION", "Storage", "service.state.artifacts", "The S3 region."),
    Variable(tokens.API_TOKEN_ENV, "Tokens", "service.ingress.auth, gangserve_client",
             "The API token for the mutating routes; without it the service generates one in "
             "$GANGSERVE_STATE_DIR/api_token (mode 0600)."),
    Variable(tokens.INFER_TOKEN_ENV, "Tokens", "service.ingress.auth, gangserve_client",
             "When set, inference needs this token (or the API token); unset, inference is open."),
    Variable(KERNEL_DIR_ENV, "Kernels", "service.parallel.native",
             "Where a CPU rank keeps the C++ kernels it builds (the sessions' decode attention, the few-row "
             "matmul: one small library each per source, compiler and CPU type; later processes load them). "
             "Default: gangserve_kernels_<uid> in the temporary directory; a directory another user owns is "
             "not used."),
    Variable(COMPILER_ENV, "Kernels", "service.parallel.native",
             f"The C++ compiler that builds them. Default: the first of {', '.join(COMPILERS)} on PATH; with "
             "none, a CPU gang's sessions gather their K/V blocks and its matmuls use torch's (slower, the "
             "same answers)."),
    Variable(FAILPOINTS_ENV, "Testing", "service.gang.failpoints",
             "1 enables the fault-injection points of the gang (tests only; never in production)."),
    *(Variable(name, "Ray Serve", "service.cluster.front_door",
               f"{value} (in the environment that starts Ray): Serve's HAProxy front door and direct "
               "ingress; without them Serve's Python proxy times X-Request-Timeout-Seconds too.")
      for name, value in FRONT_DOOR_ENV.items()),
    *(Variable(name, "Collectives", "service.cluster.netif",
               "The network interface of the gang's and the training workers' collectives; default: "
               "the interface of the node's Ray address.")
      for name in SOCKET_IFNAME_VARS),
)


def environment_markdown() -> str:
    """The environment reference as Markdown: one table, grouped."""
    lines = [
        "# Environment variables",
        "",
        "Generated from `service/environment.py` (`make docs`; `tests/test_config.py` checks it is current).",
        "Set them in the environment of every node's Ray (or a deployment's `runtime_env.env_vars`).",
        "How an app runs is set by the [builder arguments](builder-arguments.md) and their",
        "[tunables](tunables.md) section; the environment says where state lives and holds the secrets.",
        "",
        "| variable | group | read by | meaning |",
        "|---|---|---|---|",
    ]
    for v in VARIABLES:
        names = " / ".join(f"`{n.strip()}`" for n in v.name.split("/"))
        lines.append(f"| {names} | {v.group} | {v.read_by} | {v.meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m service.environment > docs/environment.md
    print(environment_markdown(), end="")
