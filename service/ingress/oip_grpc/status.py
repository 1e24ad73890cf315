"""Every error code (service.contract.errors.ErrorCode) as one gRPC status.

A code's gRPC status follows from its usual HTTP status (`GRPC_BY_HTTP`): 400, 405, 406, 415
and 422 are INVALID_ARGUMENT, 401 UNAUTHENTICATED, 404 and 410 NOT_FOUND, 409 FAILED_PRECONDITION, 413, 429 and 507 RESOURCE_EXHAUSTED, 500 INTERNAL, 503 UNAVAILABLE, 504
DEADLINE_EXCEEDED. The answer carries our code twice: the status message is
`[<code>] <message>`, and the trailing metadata has `gangserve-code: <code>` (plus
`retry-after: <seconds>` where HTTP sends Retry-After).

`python -m service.ingress.oip_grpc.status` prints docs/api.md's gRPC status table;
`--update FILE` writes it between its markers (`make docs`; tests/test_grpc.py keeps it current).
Imports no protobuf module: the test process imports this beside tritonclient's own
`inference` messages.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

from service.contract.errors import ErrorCode, GangServeError

CODE_METADATA = "gangserve-code"
RETRY_AFTER_METADATA = "retry-after"

GRPC_BY_HTTP: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.INVALID_ARGUMENT,  # never sent over gRPC (a method gRPC lacks is its own UNIMPLEMENTED)
    406: grpc.StatusCode.INVALID_ARGUMENT,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    410: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def grpc_status(code: ErrorCode) -> grpc.StatusCode:
    """The one gRPC status of `code` (by its usual HTTP status)."""
    return GRPC_BY_HTTP[code.status]


@dataclass(frozen=True)
class Failure:
    """What a failed call answers: its status, message and trailing metadata."""

    status: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str], ...]
    http_status: int  # the same error's HTTP status (the metrics' `code` label)

    @classmethod
    def of(cls, exc: GangServeError) -> "Failure":
        try:
            code = ErrorCode(str(exc.code))
        except ValueError:  # a code from elsewhere (error_from_wire) that the registry lacks
            code = ErrorCode.INTERNAL
        metadata = [(CODE_METADATA, code.value)]
        if exc.retry_after_s:
            metadata.append((RETRY_AFTER_METADATA, str(max(1, round(exc.retry_after_s)))))
        return cls(grpc_status(code), f"[{code.value}] {exc.message}", tuple(metadata), exc.status)


def status_table_markdown() -> str:
    """docs/api.md's gRPC table: one row per code, by HTTP status (the registry's order within one)."""
    rows = sorted(ErrorCode, key=lambda c: c.statuses[0] if c.statuses else 500)
    lines = ["| gRPC status | HTTP | code |", "|---|---|---|"]
    lines += [f"| `{grpc_status(c).name}` | {', '.join(str(s) for s in c.statuses) or 'any'} | `{c.value}` |"
              for c in rows]
    return "\n".join(lines) + "\n"


TABLE_BEGIN = "<!-- gRPC status table: generated from service/ingress/oip_grpc/status.py by `make docs`; do not edit -->"
TABLE_END = "<!-- end of the gRPC status table -->"


def with_status_table(document: str) -> str:
    """`document` with the text between TABLE_BEGIN and TABLE_END replaced by the current table."""
    head, begin, rest = document.partition(TABLE_BEGIN)
    _, end, tail = rest.partition(TABLE_END)
    if not begin or not end:
        raise ValueError(f"the document has no {TABLE_BEGIN!r} ... {TABLE_END!r} section")
    return f"{head}{TABLE_BEGIN}\n{status_table_markdown()}{TABLE_END}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the gRPC status table; `--update FILE` rewrites FILE's table in place."""
    parser = argparse.ArgumentParser(prog="python -m service.ingress.oip_grpc.status", description=main.__doc__)
    parser.add_argument("--update", type=Path, metavar="FILE", help="rewrite FILE's gRPC status table in place")
    args = parser.parse_args(argv)
    if args.update is None:
        sys.stdout.write(status_table_markdown())
        return 0
    args.update.write_text(with_status_table(args.update.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
