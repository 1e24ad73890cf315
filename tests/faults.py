"""Helpers for fault-injection tests: a request loop and gang probes (pid_alive: tests.helpers)."""
from __future__ import annotations

import asyncio
import io
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import torch

from tests.reference import dense_attention, relative_error


def gang_info(base: str) -> dict | None:
    """The JSON answer of `base`/gang (a 503's error body too), or None when unreachable."""
    try:
        reply = httpx.get(base + "/gang", timeout=10)
    except httpx.HTTPError:
        return None
    return reply.json()


def driver_side_policy(base: str, app_name: str = "gangserve", **overrides: object) -> object:
    """A real request policy (the ingress's code, service.ingress.requests) in this test
    process, on a real handle to app `app_name`'s GangServer, that claims rank 0's node id:
    every raylet of the test cluster runs on this machine and shares /dev/shm (where the gang
    server's socket lives), so the data channel is reachable."""
    from ray import serve

    from service.config.builder_args import AppConfig
    from service.ingress.requests import connect
    from harness.local import local_yaml_args

    handle = serve.get_deployment_handle("GangServer", app_name=app_name)
    # As an ingress replica on rank 0's node sees it.
    rank0_node = httpx.get(base + "/gang", timeout=30).json()["ranks"][0]["node_id"]
    return connect(handle, AppConfig.model_validate({**local_yaml_args(), **overrides}), node_id=rank0_node)


def transport_used(policy: object) -> dict:
    """How the policy handed tensors to the gang: its describe()'s ingress_transport (what
    GET /gang shows for an ingress replica)."""
    from service.contract.gang_status import dump

    return dump(asyncio.run(policy.describe()))["ingress_transport"]  # type: ignore[attr-defined]


def wait_for_new_gang(base: str, old_pids: set[int], timeout_s: float) -> tuple[dict, float]:
    """Poll /gang until the gang is ready without any of `old_pids` (the ranks that had to
    be replaced); returns (info, seconds)."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout_s:
        last = gang_info(base)
        if last and last.get("state") == "ready":
            pids = {r["pid"] for r in last["ranks"]}
            if not pids & old_pids:
                return last, time.monotonic() - start
        time.sleep(0.25)
    raise AssertionError(f"gang not rebuilt within {timeout_s}s; last /gang: {last}")


@dataclass
class Outcome:
    status: int
    latency_s: float
    correct: bool | None
    at: float
    body: str = ""
    # Which weights a 200 equals: 0 the loop's `weights`, i the i-th of its `alternatives`
    # (1-based); None for a wrong answer or no 200.
    source: int | None = None


@dataclass
class RequestLoop:
    """Background threads posting [rows, tokens, E] npy requests ([1, 4, E] unless told) and
    checking every 200."""

    url: str
    weights: dict
    threads: int = 2
    rows_and_tokens: tuple[int, int] = (1, 4)  # each request's [rows, tokens] (of width E)
    # Other weights a 200 may also have been computed from (e.g. during a swap): the answer
    # must equal the dense reference of exactly one of them, never a mix.
    alternatives: list[dict] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._workers = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)]
        self._lock = threading.Lock()

    def __enter__(self) -> "RequestLoop":
        for w in self._workers:
            w.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for w in self._workers:
            w.join(timeout=180)

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with httpx.Client(timeout=180) as client:
            while not self._stop.is_set():
                x = rng.standard_normal((*self.rows_and_tokens, 512), dtype=np.float32)
                buf = io.BytesIO()
                np.save(buf, x)
                t0 = time.monotonic()
                try:
                    r = client.post(self.url, content=buf.getvalue(), headers={"content-type": "application/x-npy"})
                    status, text, content = r.status_code, r.text if r.status_code != 200 else "", r.content
                except httpx.HTTPError as exc:
                    status, text, content = -1, repr(exc), b""
                latency = time.monotonic() - t0
                correct, source = None, None
                if status == 200:
                    out = np.load(io.BytesIO(content))
                    got = torch.from_numpy(out)
                    source = next((i for i, w in enumerate((self.weights, *self.alternatives))
                                   if relative_error(got, dense_attention(w, 8, torch.from_numpy(x))) < 1e-5), None)
                    correct = source is not None
                with self._lock:
                    self.outcomes.append(Outcome(status, latency, correct, t0, text, source))
                if status != 200:
                    time.sleep(0.05)

    def answered(self, after: float = 0.0) -> int:
        """How many requests started at or after `after` (time.monotonic()) were answered 200."""
        with self._lock:
            return sum(1 for o in self.outcomes if o.status == 200 and o.at >= after)

    def wait_answered(self, count: int = 1, after: float | None = None, timeout_s: float = 60) -> int:
        """Block until `count` requests started at or after `after` (default: now) were answered
        200: the load is really flowing (before a fault) or flows again (after a recovery).
        AssertionError with the outcomes so far after timeout_s."""
        since = time.monotonic() if after is None else after
        deadline = time.monotonic() + timeout_s
        while (n := self.answered(since)) < count:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{n} of {count} requests answered 200 within {timeout_s:g}s "
                                     f"(loop on {self.url}); so far {self.summary()}")
            time.sleep(0.05)
        return n

    def summary(self) -> dict[str, object]:
        with self._lock:
            outcomes = list(self.outcomes)
        statuses: dict[int, int] = {}
        for o in outcomes:
            statuses[o.status] = statuses.get(o.status, 0) + 1
        return {
            "statuses": statuses,
            "max_latency_s": round(max((o.latency_s for o in outcomes), default=0.0), 3),
            "wrong": sum(1 for o in outcomes if o.correct is False),
            "errors": sorted({f"{o.status}: {o.body[:200]}" for o in outcomes if o.status != 200})[:5],
        }


def gang_client_around_kill(client: object, x: np.ndarray, want: torch.Tensor, victim: int,
                            seconds: float = 4.0, kill_after_s: float = 1.0) -> list[str]:
    """Drive a request policy (service.ingress.requests, the ingress's code) with requests for `seconds`, kill -9 `victim`
    after `kill_after_s`; every answer must equal `want`. Returns each request's outcome:
    "ok" or the GangServeError's code."""
    from service.contract.errors import GangServeError

    outcomes: list[str] = []

    async def loop() -> None:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            try:
                out = await client.infer(x)  # type: ignore[attr-defined]
                assert relative_error(torch.from_numpy(np.array(out)), want) < 1e-5
                outcomes.append("ok")
            except GangServeError as exc:
                outcomes.append(exc.code)
                await asyncio.sleep(0.1)

    async def scenario() -> None:
        requests = asyncio.ensure_future(loop())
        await asyncio.sleep(kill_after_s)  # pacing: the requests flow for a set time before the kill
        os.kill(victim, signal.SIGKILL)
        await requests

    asyncio.run(scenario())
    return outcomes
