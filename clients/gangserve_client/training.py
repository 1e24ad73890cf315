"""Training-jobs client (`TrainingClient`: /train, /datasets, /weights); its commands on the
command line are gangserve_client.cli_training's (`gangserve train|jobs|logs|datasets|...`).

Every route here needs the API token: `token=` / --token, else $GANGSERVE_API_TOKEN, else
$GANGSERVE_STATE_DIR/api_token (default .gangserve/api_token), the places the service takes
it from (`gangserve_client.tokens`). Calls retry as `gangserve_client.retries` says (a
submission, upload, cancel or swap is resent only when it surely never left) and raise the
typed errors of `gangserve_client.errors`.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import httpx
import numpy as np

from gangserve_client import codecs, tokens
from gangserve_client.errors import JobTimeoutError
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

    def upload_dataset(self, inputs: np.ndarray, targets: np.ndarray, **more: np.ndarray) -> dict[str, Any]:
        """POST /datasets: float arrays `inputs` and `targets` (written as safetensors), and any
        of the optional tensors the service takes (`attention_mask`, `val_inputs`, `val_targets`,
        `val_attention_mask`, see docs/training.md) as keywords."""
        tensors = {"inputs": np.asarray(inputs), "targets": np.asarray(targets),
                   **{name: np.asarray(array) for name, array in more.items()}}
        return self.upload_dataset_file(codecs.encode_safetensors(tensors))

    def upload_dataset_file(self, body: bytes) -> dict[str, Any]:
        """POST /datasets with a safetensors file's bytes as they are (the service checks them)."""
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
