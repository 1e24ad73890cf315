"""Training-jobs client (`TrainingClient`: /train, /datasets, /weights) and its CLI commands
(`gangserve train|jobs|job|cancel|logs|weights`).

    gangserve train --epochs 3 --follow        # submit, show progress, exit 1 unless SUCCEEDED
    gangserve jobs                             # newest first
    gangserve weights JOB_ID                   # serve what JOB_ID trained ("reset": the config's weights)
    gangserve weights JOB_ID --max-eval-loss 0.5   # only if its final eval loss is at most 0.5
    gangserve weights list                     # the recorded versions, newest first (* = in force)
    gangserve weights rollback 3               # serve version 3 again (recorded as a new version)

Every route here needs the API token: `token=` / --token, else $GANGSERVE_API_TOKEN, else
$GANGSERVE_STATE_DIR/api_token (default .gangserve/api_token), the places the service takes
it from (`gangserve_client.tokens`). Calls retry as `gangserve_client.retries` says (a
submission, upload, cancel or swap is resent only when it surely never left) and raise the
typed errors of `gangserve_client.errors`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import httpx
import numpy as np

from gangserve_client import codecs, tokens
from gangserve_client.errors import GangServeError, JobTimeoutError
from gangserve_client.retries import RetryPolicy, send

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def resolve_token(token: str | None = None) -> str | None:
    """`token`, else the API token by the service's rule (`tokens.api_token`), else None."""
    if token:
        return token
    found = tokens.api_token()
    return found.value if found else None


class TrainingClient:
    """Synchronous client for /train, /datasets and /weights."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, token: str | None = None,
                 timeout_s: float = 60.0, retries: int = 3, retry_timeout_s: float | None = 60.0) -> None:
        token = resolve_token(token)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers)
        self._policy = RetryPolicy(retries=retries, timeout_s=retry_timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "TrainingClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, path: str, **kwargs: Any) -> httpx.Response:
        return send(self._http, self._policy, "GET", path, idempotent=True, **kwargs)

    def _post(self, path: str, **kwargs: Any) -> httpx.Response:
        return send(self._http, self._policy, "POST", path, idempotent=False, **kwargs)

    def submit(self, spec: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST /train; the accepted job (status PENDING)."""
        return self._post("/train", json=spec or {}).json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self._get(f"/train/{job_id}").json()

    def jobs(self, limit: int = 20, cursor: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        return self._get("/train", params=params).json()

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._post(f"/train/{job_id}/cancel").json()

    def delete(self, job_id: str) -> dict[str, Any]:
        """DELETE /train/{id}: cancel it if active, then remove everything it stored."""
        return send(self._http, self._policy, "DELETE", f"/train/{job_id}", idempotent=False).json()

    def logs(self, job_id: str, tail: int = 200) -> list[str]:
        return self._get(f"/train/{job_id}/logs", params={"tail": tail}).json()["lines"]

    def checkpoint(self, job_id: str) -> bytes:
        """The final checkpoint's safetensors bytes."""
        return self._get(f"/train/{job_id}/checkpoint").content

    def upload_dataset(self, inputs: np.ndarray, targets: np.ndarray) -> dict[str, Any]:
        """POST /datasets: float arrays `inputs` and `targets` (written as safetensors)."""
        body = codecs.encode_safetensors({"inputs": np.asarray(inputs), "targets": np.asarray(targets)})
        return self._post("/datasets", content=body, headers={"content-type": codecs.SAFETENSORS}).json()

    def datasets(self) -> list[dict[str, Any]]:
        return self._get("/datasets").json()["datasets"]

    def delete_dataset(self, dataset_id: str) -> dict[str, Any]:
        return send(self._http, self._policy, "DELETE", f"/datasets/{dataset_id}", idempotent=False).json()

    def load_weights(self, job_id: str | None = None, checkpoint: str | None = None,
                     reset: bool = False, max_eval_loss: float | None = None) -> dict[str, Any]:
        """POST /weights: hot-swap the serving gang to a job's (or a state-dir path's) checkpoint,
        or with `reset=True` back to the app's configured weights. The new version is recorded
        and survives replica loss and restarts. `max_eval_loss` (with `job_id`): the server
        refuses (ConflictError, code `eval_gate`) unless the job's final eval loss is at most it."""
        body: dict[str, Any] = {"reset": True} if reset else {"job_id": job_id} if job_id else {"checkpoint": checkpoint}
        if max_eval_loss is not None:
            body["max_eval_loss"] = max_eval_loss
        return self._post("/weights", json=body, timeout=330).json()

    def weights(self, limit: int = 100) -> list[dict[str, Any]]:
        """GET /weights: the app's recorded weights versions, newest first (`current`: in force)."""
        return self._get("/weights", params={"limit": limit}).json()["versions"]

    def rollback_weights(self, version: int) -> dict[str, Any]:
        """POST /weights {"version": N}: serve recorded version N again on every gang,
        recorded as a new version (`source`: "rollback of N")."""
        return self._post("/weights", json={"version": int(version)}, timeout=330).json()

    def wait(self, job_id: str, timeout_s: float = 3600.0, poll_s: float = 0.5,
             on_update: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Poll until the job ends (or timeout_s: JobTimeoutError); returns the final job."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if on_update:
                on_update(job)
            if job["status"] in TERMINAL:
                return job
            if time.monotonic() > deadline:
                raise JobTimeoutError(f"job {job_id} still {job['status']} after {timeout_s:.0f}s")
            time.sleep(poll_s)


# ---- CLI ------------------------------------------------------------------------------------

def progress_line(job: dict[str, Any], width: int = 24) -> str:
    p = job.get("progress") or {}
    epoch, epochs = int(p.get("epoch") or 0), int(p.get("epochs") or 1)
    filled = int(width * epoch / max(epochs, 1))
    loss = p.get("loss")
    loss_s = f"loss {loss:.5g}" if isinstance(loss, (int, float)) else "loss -"
    extra = job.get("reason") if job["status"] == "PENDING" else ""
    return (f"[{'#' * filled}{'-' * (width - filled)}] {epoch}/{epochs} epochs  step {p.get('step', 0)}  "
            f"{loss_s}  {job['status']}" + (f"  {extra}" if extra else ""))


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
    for key in ("world_size", "cpus_per_worker", "epochs", "batch_size", "lr", "optimizer", "max_failures"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if args.gpu:
        spec["use_gpu"] = True
    return spec


def _cmd_train(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token) as client:
        job = client.submit(_spec_from_args(args))
        print(f"submitted {job['id']} ({job['status']})", file=sys.stderr)
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


def _cmd_logs(args: argparse.Namespace) -> int:
    with TrainingClient(args.url, token=args.token) as client:
        print("\n".join(client.logs(args.job_id, tail=args.tail)))
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


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (GangServeError, codecs.WireFormatError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return run


def add_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the training subcommands; each sets `handler` (called with the parsed args)."""
    def parser(name: str, help_: str, fn: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--token", help="API token (default: $GANGSERVE_API_TOKEN or the state dir's api_token)")
        p.set_defaults(handler=_guard(fn))
        return p

    p = parser("train", "submit a DDP training job (defaults: the server's)", _cmd_train)
    p.add_argument("--spec", help="full or partial job spec as JSON; flags override it")
    p.add_argument("--model", choices=["attention", "linear"])
    p.add_argument("--embed-dim", dest="embed_dim", type=int)
    p.add_argument("--num-heads", dest="num_heads", type=int)
    p.add_argument("--in-features", dest="in_features", type=int)
    p.add_argument("--out-features", dest="out_features", type=int)
    p.add_argument("--dataset", help="an uploaded dataset id (default: synthetic)")
    p.add_argument("--samples", type=int)
    p.add_argument("--seq-len", dest="seq_len", type=int)
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
    p = parser("jobs", "list training jobs, newest first", _cmd_jobs)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--cursor")
    parser("job", "print one job", _cmd_job).add_argument("job_id")
    parser("cancel", "cancel a job", _cmd_cancel).add_argument("job_id")
    p = parser("logs", "a job's recent log lines", _cmd_logs)
    p.add_argument("job_id")
    p.add_argument("--tail", type=int, default=200)
    p = parser("weights", "serve what a SUCCEEDED attention job trained (POST /weights); 'weights list' shows the "
               "recorded versions (* = in force), 'weights rollback N' serves version N again, 'weights reset' "
               "the app's configured weights", _cmd_weights)
    p.add_argument("target", metavar="JOB_ID|list|rollback|reset")
    p.add_argument("version", nargs="?", metavar="N", help="with rollback: the version to serve again")
    p.add_argument("--max-eval-loss", dest="max_eval_loss", type=float,
                   help="with JOB_ID: refuse unless the job's final eval loss is at most this (409 eval_gate)")
    p.add_argument("--limit", type=int, default=100, help="with list: at most this many versions, newest first")
