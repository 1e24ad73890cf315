"""The `gangserve` commands of training jobs, datasets and served weights: each a thin layer
over one or two `TrainingClient` calls (gangserve_client.training), which retries and raises
the typed errors.

    gangserve datasets upload ds.npz               # .npz or .safetensors: inputs, targets (+ val_*, masks)
    gangserve datasets list | datasets delete ds-0123abcd4567
    gangserve train --dataset ds-0123abcd4567 --epochs 2 --follow   # exit 1 unless SUCCEEDED
    gangserve train --init-from current --epochs 1 # fine-tune what is served (or N, or job-...)
    gangserve jobs                                 # newest first; `jobs delete JOB_ID` removes one
    gangserve logs job-0123abcd4567 --follow       # new lines as they come, until the job ends
    gangserve checkpoint job-0123abcd4567 -o trained.safetensors
    gangserve weights job-0123abcd4567             # serve it; `weights list|rollback N|reset`

Every command needs the API token (--token, else $GANGSERVE_API_TOKEN, else the state dir's
api_token), as the routes do.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gangserve_client import codecs
from gangserve_client.errors import GangServeError, JobTimeoutError
from gangserve_client.training import TERMINAL, TrainingClient

Handler = Callable[[argparse.Namespace], int]
LOG_WINDOW = 2000  # the most lines GET /train/{id}/logs returns (its `tail` bound)


def progress_line(job: dict[str, Any], width: int = 24) -> str:
    p = job.get("progress") or {}
    epoch, epochs = int(p.get("epoch") or 0), int(p.get("epochs") or 1)
    filled = int(width * epoch / max(epochs, 1))
    loss = p.get("loss")
    loss_s = f"loss {loss:.5g}" if isinstance(loss, (int, float)) else "loss -"
    extra = job.get("reason") if job["status"] == "PENDING" else ""
    return (f"[{'#' * filled}{'-' * (width - filled)}] {epoch}/{epochs} epochs  step {p.get('step', 0)}  "
            f"{loss_s}  {job['status']}" + (f"  {extra}" if extra else ""))


def init_from(value: str) -> dict[str, Any]:
    """--init-from: "current" or a version number (a served weights version), or a job id."""
    if value == "current":
        return {"weights_version": "current"}
    if value.isdigit():
        return {"weights_version": int(value)}
    if value.startswith("job-"):
        return {"job_id": value}
    raise argparse.ArgumentTypeError(f"expected 'current', a weights version number or a job id (job-...); "
                                     f"got {value!r}")


def _spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(args.spec) if args.spec else {}
    model = dict(spec.get("model") or {})
    for key in ("embed_dim", "num_heads", "in_features", "out_features"):
        if getattr(args, key) is not None:
            model[key] = getattr(args, key)
    if args.model:
        model["kind"] = args.model
    if model:
        spec["model"] = model
    dataset = dict(spec.get("dataset") or {})
    if args.dataset:
        dataset = {"kind": "uploaded", "id": args.dataset}
    for key in ("samples", "seq_len"):
        if getattr(args, key) is not None:
            dataset[key] = getattr(args, key)
    if dataset:
        spec["dataset"] = dataset
    for key in ("world_size", "cpus_per_worker", "epochs", "batch_size", "lr", "optimizer", "max_failures",
                "init_from"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if args.gpu:
        spec["use_gpu"] = True
    return spec


def _cmd_train(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token) as client:
        job = client.submit(_spec_from_args(args))
        print(f"submitted {job['id']} ({job['status']})", file=sys.stderr, flush=True)
        if not args.follow:
            print(json.dumps(job, indent=2))
            return 0
        tty = sys.stderr.isatty()
        last = ""

        def show(j: dict[str, Any]) -> None:
            nonlocal last
            line = progress_line(j)
            if line != last:
                print(("\r" + line + "\033[K") if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
                last = line

        final = client.wait(job["id"], timeout_s=args.timeout, on_update=show)
        if tty:
            print(file=sys.stderr)
        if final["status"] != "SUCCEEDED":
            print(f"job {final['id']} {final['status']}: {final.get('error') or final.get('reason')}", file=sys.stderr)
            return 1
        losses = [h["loss"] for h in final["history"]]
        print(json.dumps({"id": final["id"], "status": final["status"], "losses": losses,
                          "checkpoint": final["checkpoint"]}, indent=2))
        return 0


def _cmd_jobs(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token) as client:
        if args.action == "delete":
            if not args.job_id:
                print("error: 'jobs delete' needs a job id (see 'gangserve jobs')", file=sys.stderr)
                return 2
            print(json.dumps(client.delete(args.job_id), indent=2))
            return 0
        if args.job_id:
            print(f"error: unexpected argument {args.job_id!r} after 'jobs'", file=sys.stderr)
            return 2
        page = client.jobs(limit=args.limit, cursor=args.cursor)
    print(f"{'ID':<18} {'STATUS':<10} {'EPOCH':>7} {'LOSS':>12}  CREATED")
    for j in page["jobs"]:
        p = j["progress"]
        loss = j["history"][-1]["loss"] if j["history"] else None
        print(f"{j['id']:<18} {j['status']:<10} {p['epoch']:>3}/{p['epochs']:<3} "
              f"{(f'{loss:.5g}' if loss is not None else '-'):>12}  {j['created_at']}")
    if page["next"]:
        print(f"more: --cursor {page['next']}")
    return 0


def _cmd_job(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token) as client:
        print(json.dumps(client.job(args.job_id), indent=2))
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token) as client:
        job = client.cancel(args.job_id)
    print(f"{job['id']} {job['status']}")
    return 0


def new_lines(shown: list[str], window: list[str]) -> list[str]:
    """The lines of `window` (the log's last N lines now) after those of `shown` (its last N
    lines at the look before): the log only grows at its end, so `window` starts with the
    longest end of `shown` it repeats, and the rest is new. When more than N lines came
    between the looks, all of `window` is new (and lines between the two are not seen)."""
    for k in range(min(len(shown), len(window)), 0, -1):
        if shown[-k:] == window[:k]:
            return window[k:]
    return window


def _cmd_logs(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token) as client:
        if not args.follow:
            print("\n".join(client.logs(args.job_id, tail=args.tail)))
            return 0
        shown = client.logs(args.job_id, tail=LOG_WINDOW)  # every look takes as many lines (new_lines)
        for line in shown[-args.tail:]:
            print(line, flush=True)
        deadline = time.monotonic() + args.timeout
        while True:
            status = client.job(args.job_id)["status"]  # before the lines: none written before the end is missed
            window = client.logs(args.job_id, tail=LOG_WINDOW)
            for line in new_lines(shown, window):
                print(line, flush=True)
            shown = window
            if status in TERMINAL:
                print(f"job {args.job_id} {status}", file=sys.stderr)
                return 0 if status == "SUCCEEDED" else 1
            if time.monotonic() > deadline:
                raise JobTimeoutError(f"job {args.job_id} still {status} after {args.timeout:g}s of --follow "
                                      "(--timeout)")
            time.sleep(args.poll)


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token, timeout_s=args.http_timeout) as client:
        body = client.checkpoint(args.job_id)
    args.output.write_bytes(body)
    print(f"{args.output}: {len(body)} bytes, tensors {', '.join(codecs.safetensors_names(body))}", file=sys.stderr)
    return 0


def _cmd_weights(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token) as client:
        if args.target == "list":
            versions = client.weights(limit=args.limit)
            print(f"  {'VERSION':>7} {'SOURCE':<16} {'EVAL_LOSS':>10} {'SHA256':<16} {'CREATED':<29} DESCRIPTION")
            for v in versions:
                loss = "-" if v.get("eval_loss") is None else f"{v['eval_loss']:.4g}"
                print(f"{'*' if v['current'] else ' '} {v['version']:>7} {v['source']:<16} {loss:>10} "
                      f"{v['sha256'][:16]:<16} {v['created_at']:<29} {v['description']}")
            return 0
        if args.target == "rollback":
            if args.version is None or not args.version.isdigit():
                print(f"error: 'weights rollback' needs a version number (see 'weights list'), got {args.version!r}",
                      file=sys.stderr)
                return 2
            reply = client.rollback_weights(int(args.version))
        elif args.version is not None:
            print(f"error: unexpected argument {args.version!r} after {args.target!r}", file=sys.stderr)
            return 2
        elif args.target == "reset":
            reply = client.load_weights(reset=True)
        else:
            reply = client.load_weights(job_id=args.target, max_eval_loss=args.max_eval_loss)
    gang = reply.get("gang", {})
    print(f"serving weights_version {reply['weights_version']} ({gang.get('weights_source')}: "
          f"{gang.get('weights_description')}, sha256 {str(gang.get('weights_sha256'))[:16]}...)"
          + ("" if reply.get("rolled_out", True) else "; not every gang has it yet (see /gangs)"))
    return 0


def dataset_body(path: Path) -> bytes:
    """A dataset file as the safetensors body POST /datasets takes: a .safetensors file as it
    is (the service checks it), a .npz file's arrays (inputs, targets, and any of
    attention_mask, val_inputs, val_targets, val_attention_mask) written as safetensors."""
    if path.suffix == ".safetensors":
        return path.read_bytes()
    if path.suffix != ".npz":
        raise SystemExit(f"{path}: a dataset is a .safetensors or .npz file (inputs, targets, ...); "
                         f"found the suffix {path.suffix!r}")
    with np.load(path, allow_pickle=False) as arrays:
        return codecs.encode_safetensors({name: arrays[name] for name in arrays.files})


def _cmd_datasets_upload(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token) as client:
        dataset = client.upload_dataset_file(dataset_body(args.file))
    print(f"uploaded {dataset['id']} ({dataset.get('kind')}, {dataset.get('samples')} samples)", file=sys.stderr)
    print(json.dumps(dataset, indent=2))
    return 0


def _cmd_datasets_list(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token) as client:
        datasets = client.datasets()
    print(f"{'ID':<18} {'KIND':<10} {'SAMPLES':>8} {'VAL':>6} {'BYTES':>10}  {'INPUTS_SHAPE':<16} CREATED")
    for d in datasets:
        print(f"{d['id']:<18} {d.get('kind', '-'):<10} {d.get('samples', '-'):>8} "
              f"{d.get('validation_samples') or 0:>6} {d.get('bytes', '-'):>10}  "
              f"{str(d.get('inputs_shape', '-')):<16} {d.get('created_at', '-')}")
    return 0


def _cmd_datasets_delete(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token) as client:
        print(json.dumps(client.delete_dataset(args.dataset_id), indent=2))
    return 0


def _guard(fn: Handler) -> Handler:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (GangServeError, codecs.WireFormatError, OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return run


def add_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register these subcommands; each sets `handler` (called with the parsed args)."""
    def parser(on: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str, help_: str,
               fn: Handler) -> argparse.ArgumentParser:
        p = on.add_parser(name, help=help_)
        p.add_argument("--token", help="API token (default: $GANGSERVE_API_TOKEN or the state dir's api_token)")
        p.set_defaults(handler=_guard(fn))
        return p

    p = parser(sub, "train", "submit a DDP training job (defaults: the server's)", _cmd_train)
    p.add_argument("--spec", help="full or partial job spec as JSON; flags override it")
    p.add_argument("--model", choices=["attention", "linear"])
    p.add_argument("--embed-dim", dest="embed_dim", type=int)
    p.add_argument("--num-heads", dest="num_heads", type=int)
    p.add_argument("--in-features", dest="in_features", type=int)
    p.add_argument("--out-features", dest="out_features", type=int)
    p.add_argument("--dataset", help="an uploaded dataset id (see 'datasets'; default: synthetic)")
    p.add_argument("--samples", type=int)
    p.add_argument("--seq-len", dest="seq_len", type=int)
    p.add_argument("--init-from", dest="init_from", type=init_from, metavar="current|N|JOB_ID",
                   help="start from these weights (fine-tuning): the served version in force, recorded "
                        "version N (see 'weights list'), or a SUCCEEDED job's checkpoint")
    p.add_argument("--world-size", dest="world_size", type=int)
    p.add_argument("--cpus-per-worker", dest="cpus_per_worker", type=float)
    p.add_argument("--gpu", action="store_true", help="one GPU per worker")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--optimizer", choices=["sgd", "adam"])
    p.add_argument("--max-failures", dest="max_failures", type=int)
    p.add_argument("--follow", action="store_true", help="show progress until the job ends; exit 1 unless SUCCEEDED")
    p.add_argument("--timeout", type=float, default=3600.0, help="--follow gives up after this many seconds")
    p = parser(sub, "jobs", "list training jobs, newest first; 'jobs delete JOB_ID' cancels one if active "
               "and removes everything it stored", _cmd_jobs)
    p.add_argument("action", nargs="?", choices=["list", "delete"], default="list")
    p.add_argument("job_id", nargs="?", metavar="JOB_ID", help="with delete: the job")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--cursor")
    parser(sub, "job", "print one job", _cmd_job).add_argument("job_id")
    parser(sub, "cancel", "cancel a job", _cmd_cancel).add_argument("job_id")
    p = parser(sub, "logs", "a job's recent log lines; --follow: then its new lines until it ends", _cmd_logs)
    p.add_argument("job_id")
    p.add_argument("--tail", type=int, default=200, help="how many of the last lines first (at most 2000)")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing new lines until the job ends; exit 1 unless it SUCCEEDED")
    p.add_argument("--poll", type=float, default=1.0, help="with --follow: seconds between looks")
    p.add_argument("--timeout", type=float, default=3600.0, help="--follow gives up after this many seconds")
    p = parser(sub, "checkpoint", "download a SUCCEEDED job's final checkpoint (safetensors)", _cmd_checkpoint)
    p.add_argument("job_id")
    p.add_argument("-o", "--output", type=Path, required=True, help="the file to write")
    p.add_argument("--http-timeout", dest="http_timeout", type=float, default=300.0,
                   help="seconds the download may take")
    p = parser(sub, "weights", "serve what a SUCCEEDED attention job trained (POST /weights); 'weights list' "
               "shows the recorded versions (* = in force), 'weights rollback N' serves version N again, "
               "'weights reset' the app's configured weights", _cmd_weights)
    p.add_argument("target", metavar="JOB_ID|list|rollback|reset")
    p.add_argument("version", nargs="?", metavar="N", help="with rollback: the version to serve again")
    p.add_argument("--max-eval-loss", dest="max_eval_loss", type=float,
                   help="with JOB_ID: refuse unless the job's final eval loss is at most this (409 eval_gate)")
    p.add_argument("--limit", type=int, default=100, help="with list: at most this many versions, newest first")
    datasets = sub.add_parser("datasets", help="upload, list or delete training datasets")
    actions = datasets.add_subparsers(dest="datasets_command", required=True, metavar="upload|list|delete")
    p = parser(actions, "upload", "upload a .npz or .safetensors file: inputs, targets (and optionally "
               "attention_mask, val_inputs, val_targets, val_attention_mask); prints the dataset", _cmd_datasets_upload)
    p.add_argument("file", type=Path)
    parser(actions, "list", "the uploaded datasets, newest first", _cmd_datasets_list)
    parser(actions, "delete", "delete a dataset no active job trains on", _cmd_datasets_delete).add_argument("dataset_id")
