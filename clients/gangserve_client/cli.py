"""gangserve: the command line of gangserve-client.

    gangserve infer input.npy -o out.npy                 # also .safetensors in/out
    gangserve infer x.safetensors -o y.safetensors --output-dtype bfloat16
    gangserve infer x.npy --mask mask.npy --causal        # a padding mask [batch, seq] of 0/1; causal attention
    gangserve session rows1.npy rows2.npy -o out          # one session: each file's rows appended in turn
    gangserve gang                                       # the gang's ranks and state
    gangserve ready
    gangserve bench --shape 1,16,512 --concurrency 1,4,16 --duration 10   # see gangserve_client.bench
    gangserve datasets upload ds.npz                     # training: see gangserve_client.cli_training
    gangserve train --dataset ds-... --epochs 2 --follow
    gangserve jobs | logs JOB --follow | checkpoint JOB -o FILE | weights JOB

`python -m gangserve_client` is the same command. Tokens: see gangserve_client.tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from gangserve_client import bench, cli_training, codecs
from gangserve_client.client import DEFAULT_URL, GangServeClient
from gangserve_client.errors import GangServeError


def read_tensor(path: Path) -> np.ndarray:
    """The input tensor of a .npy file or of a .safetensors file (hidden_states, or its only tensor)."""
    body = path.read_bytes()
    if path.suffix == ".safetensors":
        names = codecs.safetensors_names(body)
        name = codecs.INPUT_NAME if codecs.INPUT_NAME in names else names[0] if len(names) == 1 else None
        if name is None:
            raise SystemExit(f"{path}: expected a tensor named {codecs.INPUT_NAME}, found {sorted(names)}")
        return np.array(codecs.decode_safetensors(body, name=name))
    return np.array(codecs.decode_npy(body))


def read_mask(path: Path) -> np.ndarray:
    """An attention mask [batch, seq] (or [seq]) of 0/1: a .npy file of integers or booleans, or
    the `attention_mask` tensor of a .safetensors file."""
    if path.suffix == ".safetensors":
        mask = codecs.decode_safetensors_mask(path.read_bytes())
        if mask is None:
            raise SystemExit(f"{path}: expected a tensor named {codecs.MASK_NAME}, found "
                             f"{sorted(codecs.safetensors_names(path.read_bytes()))}")
        return np.array(mask)
    mask = np.load(path, allow_pickle=False)
    if mask.dtype.kind not in "biu":
        raise SystemExit(f"{path}: an attention mask holds integers or booleans (1 = token, 0 = padding); "
                         f"found dtype {mask.dtype}")
    return mask


def write_tensor(path: Path, array: np.ndarray) -> None:
    if path.suffix == ".safetensors":
        path.write_bytes(codecs.encode_safetensors({codecs.OUTPUT_NAME: array}))
    elif codecs.is_bfloat16(array.dtype):
        raise SystemExit(f"{path}: npy cannot hold bfloat16; write a .safetensors file instead")
    else:
        path.write_bytes(codecs.encode_npy(array))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gangserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=DEFAULT_URL, help="service base URL")
    sub = parser.add_subparsers(dest="command", required=True)
    p_infer = sub.add_parser("infer", help="run attention on a .npy or .safetensors tensor")
    p_infer.add_argument("input", type=Path)
    p_infer.add_argument("-o", "--output", type=Path, help="write the result (.npy or .safetensors)")
    p_infer.add_argument("--format", choices=["safetensors", "npy", "json"], default="safetensors",
                         help="wire format (default safetensors)")
    p_infer.add_argument("--output-dtype", choices=list(codecs.DTYPE_NAMES),
                         help="reply dtype (default: the input's dtype)")
    p_infer.add_argument("--token", help="inference token (default: $GANGSERVE_INFER_TOKEN)")
    p_infer.add_argument("--deadline", type=float, metavar="SECONDS",
                         help="the request's deadline (X-Request-Timeout-Seconds; default: the service's)")
    p_infer.add_argument("--mask", type=Path, metavar="FILE",
                         help="attention mask [batch, seq] (or [seq]): 1 = token, 0 = padding; a .npy file of "
                              "integers or booleans, or a .safetensors file's attention_mask (not with --format npy)")
    p_infer.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                         help="causal attention (each position sees itself and earlier ones); --no-causal: "
                              "full attention (default: the served model's)")
    p_session = sub.add_parser("session", help="open a session, append each file's rows [n, E] in turn, end it")
    p_session.add_argument("inputs", type=Path, nargs="+")
    p_session.add_argument("-o", "--output", type=Path, help="write each answer as OUTPUT-<i>.npy")
    p_session.add_argument("--keep", action="store_true", help="do not end the session (print its id)")
    p_session.add_argument("--token", help="inference token (default: $GANGSERVE_INFER_TOKEN)")
    sub.add_parser("gang", help="print GET /gang")
    sub.add_parser("ready", help="exit 0 if the gang is ready")
    cli_training.add_commands(sub)
    bench.add_command(sub)
    args = parser.parse_args(argv)
    if getattr(args, "handler", None):  # training subcommands
        return args.handler(args)

    try:
        with GangServeClient(args.url, infer_token=getattr(args, "token", None)) as client:
            if args.command == "infer":
                mask = read_mask(args.mask) if args.mask else None
                out = client.infer(read_tensor(args.input), fmt=args.format, output_dtype=args.output_dtype,
                                   deadline_s=args.deadline, attention_mask=mask, causal=args.causal)
                if args.output:
                    write_tensor(args.output, out)
                print(f"output shape {list(out.shape)} dtype {codecs.dtype_name(out.dtype)} "
                      f"mean {float(out.astype(np.float64).mean()):.6g}")
            elif args.command == "session":
                session = client.session()
                for i, path in enumerate(args.inputs):
                    out = session.append(read_tensor(path))
                    if args.output:
                        write_tensor(args.output.with_name(f"{args.output.stem}-{i}.npy"), out)
                    print(f"{path}: output shape {list(out.shape)}; session {session.id} length {session.length} "
                          f"weights version {session.weights_version}")
                if not args.keep:
                    session.close()
            elif args.command == "gang":
                print(json.dumps(client.gang(), indent=2))
            elif args.command == "ready":
                ok = client.ready()
                print("ready" if ok else "not ready")
                return 0 if ok else 1
    except (GangServeError, codecs.WireFormatError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
