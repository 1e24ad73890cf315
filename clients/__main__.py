"""gangserve CLI.

    python -m clients infer input.npy -o out.npy          # also .safetensors in/out
    python -m clients gang                                  # the gang's ranks and state
    python -m clients ready
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from clients.client import GangServeClient, GangServeHTTPError


def _read_tensor(path: Path) -> np.ndarray:
    if path.suffix == ".safetensors":
        tensors = load_file(str(path))
        if "hidden_states" in tensors:
            return tensors["hidden_states"]
        if len(tensors) == 1:
            return next(iter(tensors.values()))
        raise SystemExit(f"{path}: expected a tensor named hidden_states, found {sorted(tensors)}")
    return np.load(path, allow_pickle=False)


def _write_tensor(path: Path, array: np.ndarray) -> None:
    if path.suffix == ".safetensors":
        save_file({"output": np.ascontiguousarray(array)}, str(path))
    else:
        np.save(path, array, allow_pickle=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clients", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="service base URL")
    sub = parser.add_subparsers(dest="command", required=True)
    p_infer = sub.add_parser("infer", help="run attention on a .npy or .safetensors tensor")
    p_infer.add_argument("input", type=Path)
    p_infer.add_argument("-o", "--output", type=Path, help="write the result (.npy or .safetensors)")
    p_infer.add_argument("--format", choices=["safetensors", "npy", "json"], default="safetensors",
                         help="wire format (default safetensors)")
    sub.add_parser("gang", help="print GET /gang")
    sub.add_parser("ready", help="exit 0 if the gang is ready")
    args = parser.parse_args(argv)

    with GangServeClient(args.url) as client:
        try:
            if args.command == "infer":
                out = client.infer(_read_tensor(args.input), fmt=args.format)
                if args.output:
                    _write_tensor(args.output, out)
                print(f"output shape {list(out.shape)} dtype {out.dtype} mean {float(out.mean()):.6g}")
            elif args.command == "gang":
                print(json.dumps(client.gang(), indent=2))
            elif args.command == "ready":
                ok = client.ready()
                print("ready" if ok else "not ready")
                return 0 if ok else 1
        except GangServeHTTPError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
