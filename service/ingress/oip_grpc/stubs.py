"""`python -m service.ingress.oip_grpc.stubs [--check]`: the Python module of the gRPC protocol.

The service's `.proto` (gangserve_inference.proto, beside this file) is compiled by
grpcio-tools (pinned in constraints.txt; the test extra installs it) into
gangserve_inference_pb2.py and its .pyi, which are committed: a fresh clone serves and tests
without running the compiler. Only the messages are generated (`--python_out`, `--pyi_out`),
no `_pb2_grpc.py`: the service registers its methods itself (service.ingress.oip_grpc.servicer),
taking each request's raw bytes so that a malformed message is answered with our own status.

The module's messages are built in a descriptor pool of their own (`POOL`), not protobuf's
default pool: their names are Triton's (`inference.ModelInferRequest`, ...), and a process that
also imports tritonclient.grpc (the tests, a user's own code) would otherwise fail with
"duplicate symbol". The wire format does not carry message names, so nothing else changes.

Without arguments the files are written; `--check` exits 1, naming the stale file, when the
committed ones differ from what the compiler makes now (tests/test_grpc.py runs it).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "gangserve_inference.proto"
OUTPUTS = ("gangserve_inference_pb2.py", "gangserve_inference_pb2.pyi")
HEADER = ("# Generated from service/ingress/oip_grpc/gangserve_inference.proto by\n"
          "# `python -m service.ingress.oip_grpc.stubs` (grpcio-tools, constraints.txt). Do not edit: change the\n"
          "# .proto and run it again (tests/test_grpc.py checks that this file is current).\n")


def generate() -> dict[str, str]:
    """The generated files' text, by name (header included), compiled now."""
    from grpc_tools import protoc  # the test extra: only for making the stubs

    with tempfile.TemporaryDirectory() as out:
        status = protoc.main(["grpc_tools.protoc", f"-I{HERE}", f"--python_out={out}", f"--pyi_out={out}",
                              str(HERE / PROTO)])
        if status != 0:
            raise RuntimeError(f"protoc failed on {HERE / PROTO} (exit {status})")
        texts = {name: HEADER + (Path(out) / name).read_text() for name in OUTPUTS}
    return {name: _private_pool(text) if name.endswith(".py") else text for name, text in texts.items()}


_DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
_OWN_POOL = ("# gangserve: the messages live in a pool of their own, not protobuf's default one, so that\n"
             "# a process may also import another `inference` package (tritonclient.grpc's, KServe's).\n"
             "POOL = _descriptor_pool.DescriptorPool()\n"
             "DESCRIPTOR = POOL.AddSerializedFile(")


def _private_pool(text: str) -> str:
    """The generated module with its file added to a pool of its own (`POOL`) instead of the
    default pool: the message names (`inference.ModelInferRequest`, ...) are Triton's, and a
    second module that declares them (tritonclient.grpc's service_pb2) would clash there."""
    if text.count(_DEFAULT_POOL) != 1:
        raise RuntimeError("protoc's output changed: it no longer adds the file to the default pool once")
    return text.replace(_DEFAULT_POOL, _OWN_POOL)


def stale(generated: dict[str, str]) -> list[str]:
    """The committed files that differ from `generated` (or are missing)."""
    return [name for name, text in generated.items()
            if not (HERE / name).exists() or (HERE / name).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.ingress.oip_grpc.stubs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed files are not current")
    args = parser.parse_args(argv)
    generated = generate()
    if args.check:
        old = stale(generated)
        if old:
            print(f"stale: {', '.join(old)}; run `python -m service.ingress.oip_grpc.stubs`", file=sys.stderr)
            return 1
        return 0
    for name, text in generated.items():
        (HERE / name).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
