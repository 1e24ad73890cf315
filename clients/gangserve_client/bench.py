"""`gangserve bench`: a load generator for any gangserve deployment's POST /infer.

    gangserve --url http://host:8000 bench --shape 1,16,512 --format safetensors \\
        --concurrency 1,4,16 --duration 10 --json bench.json

For each concurrency level, that many workers send requests back to back for `--duration`
seconds (after `--warmup` seconds not counted); out come p50 and p99 latency and answered
requests per second per level, as a table and, with --json, as JSON (`BenchReport.to_json`).
As `vllm bench serve` or `perf_analyzer` do for theirs.

The load generator only sends: the request bodies are encoded once, up front (`--bodies`
distinct random inputs, sent in turn), and a worker does nothing between requests but take
the time and keep it; percentiles are computed after the level ends. Requests are sent as
they are, never retried: a refused or failed one counts as an error (by HTTP status, or the
transport error's name), and only answered (200) ones count towards latency and req/s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

from gangserve_client import tokens
from gangserve_client.client import DEADLINE_HEADER, FORMATS, encode_request


@dataclass(frozen=True)
class BenchConfig:
    """What to send where: `url` the deployment's base URL (its route prefix included)."""

    url: str
    shape: tuple[int, ...] = (1, 16, 512)
    fmt: str = "safetensors"
    concurrency: tuple[int, ...] = (1, 4, 16)
    duration_s: float = 10.0
    warmup_s: float = 1.0
    path: str = "/infer"
    token: str | None = None
    causal: bool | None = None
    deadline_s: float | None = None
    request_timeout_s: float = 60.0
    bodies: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {self.fmt!r}")
        if len(self.shape) not in (2, 3) or min(self.shape) < 1:
            raise ValueError(f"shape must be [seq, E] or [batch, seq, E] of positive sizes; got {list(self.shape)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be positive integers; got {list(self.concurrency)}")
        if not self.duration_s > 0 or self.warmup_s < 0 or not self.request_timeout_s > 0 or self.bodies < 1:
            raise ValueError(f"duration_s and request_timeout_s must be > 0, warmup_s >= 0 and bodies >= 1; got "
                             f"{self.duration_s}, {self.request_timeout_s}, {self.warmup_s}, {self.bodies}")


@dataclass(frozen=True)
class LevelResult:
    """One concurrency level: `requests` answered 200 within its window (plus those that were
    in flight when it closed), `errors` by HTTP status or transport error, latencies in ms."""

    concurrency: int
    requests: int
    errors: int
    error_kinds: dict[str, int]
    seconds: float
    req_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    max_ms: float | None


@dataclass(frozen=True)
class BenchReport:
    """A bench run: what was sent and one LevelResult per concurrency level."""

    url: str
    path: str
    shape: list[int]
    format: str
    request_bytes: int
    duration_s: float
    warmup_s: float
    levels: list[LevelResult] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def table(self) -> str:
        lines = [f"POST {self.url.rstrip('/')}{self.path}: shape {self.shape}, {self.format}, "
                 f"{self.request_bytes} bytes a request, {self.duration_s:g} s a level",
                 f"{'CONCURRENCY':>11} {'REQUESTS':>9} {'ERRORS':>7} {'REQ/S':>9} {'P50_MS':>9} {'P99_MS':>9} "
                 f"{'MAX_MS':>9}"]
        for r in self.levels:
            def ms(v: float | None) -> str:
                return "-" if v is None else f"{v:.2f}"
            lines.append(f"{r.concurrency:>11} {r.requests:>9} {r.errors:>7} {r.req_per_s:>9.1f} {ms(r.p50_ms):>9} "
                         f"{ms(r.p99_ms):>9} {ms(r.max_ms):>9}"
                         + (f"  errors: {r.error_kinds}" if r.error_kinds else ""))
        return "\n".join(lines)


@dataclass
class _Tally:
    """What the workers of one level write: latencies (s) of answered requests, error kinds."""

    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    last_done: float = 0.0


def request_bodies(cfg: BenchConfig) -> tuple[list[bytes], dict[str, str], dict[str, str] | None]:
    """The bodies (encoded once, here), the headers and the query of every request."""
    rng = np.random.default_rng(cfg.seed)
    bodies, media = [], ""
    for _ in range(cfg.bodies):
        body, media = encode_request(rng.standard_normal(cfg.shape, dtype=np.float32), cfg.fmt)
        bodies.append(body)
    token = cfg.token or tokens.infer_token()
    headers = {"content-type": media, "accept": media, **({"authorization": f"Bearer {token}"} if token else {})}
    if cfg.deadline_s is not None:
        headers[DEADLINE_HEADER] = f"{cfg.deadline_s:.6g}"
    params = None if cfg.causal is None else {"causal": "true" if cfg.causal else "false"}
    return bodies, headers, params


async def _worker(http: httpx.AsyncClient, path: str, bodies: list[bytes], headers: dict[str, str],
                  params: dict[str, str] | None, start: int, until: float, tally: _Tally | None) -> None:
    """Send back to back until `until` (perf_counter); `tally` None: warmup, nothing kept."""
    i = start
    while time.perf_counter() < until:
        body = bodies[i % len(bodies)]
        i += 1
        t0 = time.perf_counter()
        try:
            reply = await http.post(path, content=body, headers=headers, params=params)
            kind = None if reply.status_code == 200 else str(reply.status_code)
        except httpx.TimeoutException:
            kind = "timeout"
        except httpx.TransportError as exc:
            kind = type(exc).__name__
        done = time.perf_counter()
        if tally is None:
            continue
        if kind is None:
            tally.latencies.append(done - t0)
        else:
            tally.errors[kind] = tally.errors.get(kind, 0) + 1
        tally.last_done = done


async def _level(cfg: BenchConfig, concurrency: int, bodies: list[bytes], headers: dict[str, str],
                 params: dict[str, str] | None) -> LevelResult:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=cfg.url.rstrip("/"), timeout=cfg.request_timeout_s, limits=limits) as http:
        if cfg.warmup_s > 0:
            until = time.perf_counter() + cfg.warmup_s
            await asyncio.gather(*(_worker(http, cfg.path, bodies, headers, params, w, until, None)
                                   for w in range(concurrency)))
        tally = _Tally()
        began = time.perf_counter()
        await asyncio.gather(*(_worker(http, cfg.path, bodies, headers, params, w, began + cfg.duration_s, tally)
                               for w in range(concurrency)))
    return summarize(concurrency, tally.latencies, tally.errors, max(tally.last_done, began + cfg.duration_s) - began)


def summarize(concurrency: int, latencies_s: list[float], errors: dict[str, int], seconds: float) -> LevelResult:
    """A level's figures from what its workers kept (computed after the level, never while sending)."""
    ms = np.asarray(latencies_s, dtype=np.float64) * 1000.0
    have = ms.size > 0
    return LevelResult(
        concurrency=concurrency, requests=int(ms.size), errors=sum(errors.values()), error_kinds=dict(errors),
        seconds=round(seconds, 3), req_per_s=round(ms.size / seconds, 2) if seconds > 0 else 0.0,
        p50_ms=round(float(np.percentile(ms, 50)), 3) if have else None,
        p99_ms=round(float(np.percentile(ms, 99)), 3) if have else None,
        mean_ms=round(float(ms.mean()), 3) if have else None,
        max_ms=round(float(ms.max()), 3) if have else None,
    )


def run(cfg: BenchConfig, on_level: Callable[[LevelResult], None] | None = None) -> BenchReport:
    """Every level of `cfg`, one after the other; `on_level` is told of each as it ends."""
    bodies, headers, params = request_bodies(cfg)
    report = BenchReport(url=cfg.url, path=cfg.path, shape=list(cfg.shape), format=cfg.fmt,
                         request_bytes=len(bodies[0]), duration_s=cfg.duration_s, warmup_s=cfg.warmup_s)
    for concurrency in cfg.concurrency:
        result = asyncio.run(_level(cfg, concurrency, bodies, headers, params))
        report.levels.append(result)
        if on_level is not None:
            on_level(result)
    return report


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 1,4,16; got {text!r}") from None


def _cmd_bench(args: argparse.Namespace) -> int:
    try:
        cfg = BenchConfig(url=args.url, shape=args.shape, fmt=args.format, concurrency=args.concurrency,
                          duration_s=args.duration, warmup_s=args.warmup, path=args.path, token=args.token,
                          causal=args.causal, deadline_s=args.deadline, request_timeout_s=args.request_timeout,
                          bodies=args.bodies, seed=args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    as_json = args.json == "-"
    report = run(cfg, on_level=lambda r: print(f"concurrency {r.concurrency}: {r.requests} answered, {r.errors} "
                                               f"errors, {r.req_per_s:.1f} req/s", file=sys.stderr, flush=True))
    if as_json:
        print(report.to_json())
    else:
        print(report.table())
        if args.json:
            Path(args.json).write_text(report.to_json() + "\n")
    silent = [r.concurrency for r in report.levels if r.requests == 0]
    if silent:
        print(f"error: no request answered 200 at concurrency {silent}; errors: "
              f"{[r.error_kinds for r in report.levels if r.requests == 0]}", file=sys.stderr)
        return 1
    return 0


def add_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register `bench` (it sets `handler`)."""
    p = sub.add_parser("bench", help="load-test POST /infer of a deployment: p50/p99 and req/s per concurrency",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=_ints, default=(1, 16, 512), help="request tensor [batch,seq,E] or [seq,E] "
                   "(default 1,16,512)")
    p.add_argument("--format", choices=list(FORMATS), default="safetensors", help="request and reply body format")
    p.add_argument("--concurrency", type=_ints, default=(1, 4, 16), help="levels, e.g. 1,4,16 (default)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per level (default 10)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds sent, not counted, before each level")
    p.add_argument("--path", default="/infer", help="the route under --url (default /infer)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None, help="?causal=true|false")
    p.add_argument("--deadline", type=float, metavar="SECONDS", help="X-Request-Timeout-Seconds on every request")
    p.add_argument("--request-timeout", dest="request_timeout", type=float, default=60.0,
                   help="client-side bound on one request (counted as a 'timeout' error)")
    p.add_argument("--bodies", type=int, default=8, help="distinct random inputs, encoded up front, sent in turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token", help="inference token (default: $GANGSERVE_INFER_TOKEN)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE ('-': JSON on stdout "
                   "instead of the table)")
    p.set_defaults(handler=_cmd_bench)
