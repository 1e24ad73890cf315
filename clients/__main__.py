"""gangserve CLI.

    python -m clients infer input.npy -o out.npy          # also .safetensors in/out
    python -m clients infer x.safetensors -o y.safetensors --output-dtype bfloat16
    python -m clients gang                                  # the gang's ranks and state
    python -m clients ready
    python -m clients train --epochs 3 --follow             # training jobs: see clients/training.py
    python -m clients jobs
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from safetensors import safe_open

from clients import training
from clients.client import GangServeClient, GangServeHTTPError
from service import codecs


def _read_tensor(path: Path) -> np.ndarray:
    """The input tensor of a .npy file or of a .safetensors file (hidden_states, or its only tensor)."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="numpy") as f:  # reads the header only
            names = list(f.keys())
        name = "hidden_states" if "hidden_states" in names else names[0] if len(names) == 1 else None
        if name is None:
            raise SystemExit(f"{path}: expected a tensor named hidden_states, found {sorted(names)}")
        # The codecs read every float dtype, bfloat16 included (safetensors.numpy cannot).
        return np.array(codecs.decode_safetensors(path.read_bytes(), name=name))
    return np.load(path, allow_pickle=False)


def _write_tensor(path: Path, array: np.ndarray) -> None:
    if path.suffix == ".safetensors":
        path.write_bytes(codecs.encode_safetensors({"output": array}))
    elif array.dtype == codecs.BFLOAT16:
        raise SystemExit(f"{path}: npy cannot hold bfloat16; write a .safetensors file instead")
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
    p_infer.add_argument("--output-dtype", choices=list(codecs.DTYPE_NAMES),
                         help="reply dtype (default: the input's dtype)")
    sub.add_parser("gang", help="print GET /gang")
    sub.add_parser("ready", help="exit 0 if the gang is ready")
    training.add_commands(sub)
    args = parser.parse_args(argv)
    if getattr(args, "handler", None):  # training subcommands
        return args.handler(args)

    with GangServeClient(args.url) as client:
        try:
            if args.command == "infer":
                out = client.infer(_read_tensor(args.input), fmt=args.format, output_dtype=args.output_dtype)
                if args.output:
                    _write_tensor(args.output, out)
                print(f"output shape {list(out.shape)} dtype {codecs.dtype_name(out.dtype)} "
                      f"mean {float(out.astype(np.float64).mean()):.6g}")
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
