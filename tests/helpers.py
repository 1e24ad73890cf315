"""Small helpers shared by the test modules (a test module never imports another one).

HTTP calls against a served app, job polling, the error-shape check, conditions instead
of fixed sleeps, and random request tensors.
"""
from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from service.cluster.scratch import pid_alive  # noqa: F401 - re-exported: tests import it from here
from tests.conftest import TEST_API_TOKEN

T = TypeVar("T")

AUTH = {"authorization": f"Bearer {TEST_API_TOKEN}"}
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
# Tests reserve a quarter CPU per worker so the overlapping jobs fit next to the gang.
SMALL = {"cpus_per_worker": 0.25}


def eventually(probe: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.25) -> T:
    """Call `probe` until it returns something truthy (returned), at most `timeout_s`;
    AssertionError naming `what` and the last value otherwise. Exceptions of httpx count
    as "not yet" (a replica restarting), any other exception propagates."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = probe()
            if last:
                return last
        except httpx.HTTPError as exc:
            last = repr(exc)
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g}s; last: {str(last)[:1500]}")
        time.sleep(interval_s)


async def eventually_async(probe: Callable[[], T | None], timeout_s: float, what: str,
                           interval_s: float = 0.01) -> T:
    """`eventually` inside an event loop: the loop runs (other tasks progress) between probes."""
    deadline = time.monotonic() + timeout_s
    while not (last := probe()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g}s; last: {str(last)[:1500]}")
        await asyncio.sleep(interval_s)
    return last


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    """Standard-normal float32 tensor of `shape`, reproducible from `seed`."""
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def npy_bytes(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    return buf.getvalue()


@contextlib.contextmanager
def one_decode_slot_held(pool: Any, hold_s: float = 30.0) -> Iterator[Callable[[], None]]:
    """One slot of an ingress DecodePool (service.ingress.deps) taken by a pool thread that waits
    (at most `hold_s`) until the block ends. Yields `free()`, which lets it go earlier and waits
    until the slot is free again."""
    release = threading.Event()
    holder = threading.Thread(target=lambda: asyncio.run(pool.run(release.wait, hold_s)))

    def free() -> None:
        release.set()
        holder.join(10)
        eventually(lambda: pool.pending == 0, 10, "the slot freed")

    holder.start()
    try:
        eventually(lambda: pool.pending == 1, 10, "the one slot taken")
        yield free
    finally:
        release.set()
        holder.join(10)


def post(url: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    """POST JSON `body` to url+path with the test token (headers= replaces it)."""
    return httpx.post(url + path, json=body, headers=kw.pop("headers", AUTH), timeout=kw.pop("timeout", 60), **kw)


def assert_error(reply: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The reply has `status` and the service's error shape {"error": str, "code": ...}."""
    assert reply.status_code == status, (reply.status_code, reply.text)
    doc = reply.json()
    assert isinstance(doc.get("error"), str) and doc["error"], doc
    if code is not None:
        assert doc["code"] == code, doc
    return doc


def state_dir() -> Path:
    return Path(os.environ["GANGSERVE_STATE_DIR"])


def get_job(url: str, job_id: str) -> dict[str, Any]:
    # Polling only: once in ~10 full runs the Serve proxy closed a fresh connection without
    # answering (httpx.RemoteProtocolError, nothing in the proxy's or ingress's log); the
    # job's state is what these tests check, so one transport-level retry is allowed.
    for attempt in range(2):
        try:
            reply = httpx.get(f"{url}/train/{job_id}", headers=AUTH, timeout=30)
            break
        except httpx.RemoteProtocolError:
            if attempt:
                raise
            time.sleep(0.5)
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_for(url: str, job_id: str, pred: Any, timeout_s: float, what: str) -> dict[str, Any]:
    """Poll the job until pred(job) (returned); AssertionError with the record and the last
    log lines when it ends otherwise or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = get_job(url, job_id)
        if pred(job):
            return job
        if job["status"] in TERMINAL:
            break
        time.sleep(0.25)
    logs = httpx.get(f"{url}/train/{job_id}/logs", headers=AUTH, timeout=30).json().get("lines", [])
    raise AssertionError(f"job {job_id} never {what}; last: {json.dumps(job)[:1500]}\nlogs:\n" + "\n".join(logs[-40:]))


def wait_done(url: str, job_id: str, timeout_s: float = 300) -> dict[str, Any]:
    return wait_for(url, job_id, lambda j: j["status"] in TERMINAL, timeout_s, "ended")


# ---- /metrics ------------------------------------------------------------------------------

def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One scrape of base/metrics: {(sample name, sorted labels): value}."""
    reply = httpx.get(base + "/metrics", timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(reply.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def poll(base: str, pred: Callable[[dict], bool], timeout_s: float, what: str) -> dict:
    """Scrape base/metrics until pred(samples) (returned), at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    samples: dict = {}
    while time.monotonic() < deadline:
        samples = scrape(base)
        if pred(samples):
            return samples
        time.sleep(0.5)
    gangserve = {k: v for k, v in samples.items() if "gang" in k[0] or "training" in k[0]}
    raise AssertionError(f"{what} not seen within {timeout_s:.0f}s; last gang/training samples: {gangserve}")


# ---- error codes in the source (read with ast) ------------------------------------------

@dataclass(frozen=True)
class CodeSite:
    """One place in service/ that writes an error code: `code=` in a call (`raised` names the
    called class, e.g. "Conflict"), a class's `code = ...`, or a `"code": ...` dict entry.
    `literal` is the string written there, `member` the ErrorCode member's name, `fstring`
    the source of an f-string (else each is None)."""

    path: str
    line: int
    raised: str | None
    literal: str | None
    member: str | None
    fstring: str | None


def code_sites(root: Path) -> list[CodeSite]:
    """Every CodeSite in root/service (errors.py, the registry itself, included)."""
    sites = []
    for path in sorted((root / "service").rglob("*.py")):
        rel, source = str(path.relative_to(root)), path.read_text()

        def site(node: ast.AST, value: ast.AST, raised: str | None = None) -> CodeSite:
            literal = value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None
            member = (value.attr if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
                      and value.value.id == "ErrorCode" else None)
            fstring = ast.get_source_segment(source, value) if isinstance(value, ast.JoinedStr) else None
            return CodeSite(rel, getattr(node, "lineno", 0), raised, literal, member, fstring)

        for node in ast.walk(ast.parse(source, rel)):
            if isinstance(node, ast.Call):
                raised = node.func.id if isinstance(node.func, ast.Name) else None
                sites += [site(node, kw.value, raised) for kw in node.keywords if kw.arg == "code"]
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                        target, value = stmt.targets[0], stmt.value
                        if isinstance(target, ast.Name) and target.id == "code":
                            sites.append(site(stmt, value))
                        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                            sites += [site(stmt, v) for t, v in zip(target.elts, value.elts)
                                      if isinstance(t, ast.Name) and t.id == "code"]
            elif isinstance(node, ast.Dict):
                sites += [site(node, v) for k, v in zip(node.keys, node.values)
                          if isinstance(k, ast.Constant) and k.value == "code"]
    return sites


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's (INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    steps: list[tuple[str, str]] = []
    pending = ""
    for raw in (Path(__file__).resolve().parents[1] / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        instruction, _, args = (pending + line).partition(" ")
        steps.append((instruction.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return steps


@contextlib.contextmanager
def spawned_gloo_group(rank: int, world_size: int, work: Path) -> Iterator[Any]:
    """In a spawned rank process: one thread, a real gloo process group over a FileStore in
    `work`, as a service.parallel ParallelGroup on the CPU; destroyed on exit."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    from service.parallel.group import ParallelGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(str(work / "store"), world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        yield ParallelGroup(rank, world_size, "gloo", torch.device("cpu"), dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def train_and_save(model: Any, spec: Any, x: Any, y: Any, tokens: Any, path: Path, steps: int = 2) -> None:
    """`steps` SGD steps of a job's model on the training loss (masked rows out), so a
    checkpoint holds trained weights, not the init; then the job's checkpoint at `path`."""
    import torch

    from service.training.models import save_model
    from service.training.runner import vector_sq_error

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        loss = vector_sq_error(model(x, tokens), y, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_model(model, spec, path)
