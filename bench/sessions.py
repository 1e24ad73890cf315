"""`python bench/run.py --only sessions`: stateful sessions (issue 31) against the stateless path.

Rows (world size 2, gloo, npy bodies, p50 over `n` calls):
- a one-row append at context 16 vs at context 2048 (goal: <= 2x);
- the stateless alternative: POST /infer ?causal=true with the 2049-row prefix, keeping the
  last row (goal: the append at 2048 >= 10x faster);
- 32 sessions appending one row each at once: gang steps per append (goal: <= 1/4) and
  appends/s vs the same appends sent one at a time (goal: >= 3x).
"""
from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np

E = 512
NPY = {"content-type": "application/x-npy"}


def _npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    return buf.getvalue()


def _open(client: httpx.Client, base: str, prefill: np.ndarray) -> str:
    r = client.post(f"{base}/sessions", content=_npy(prefill), headers=NPY)
    r.raise_for_status()
    return r.headers["x-session-id"]


def _p50(samples: list[float]) -> float:
    return round(float(np.percentile(np.asarray(samples) * 1000, 50)), 3)


def _appends(client: httpx.Client, base: str, sid: str, n: int, rng: np.random.Generator) -> list[float]:
    out = []
    for _ in range(n):
        body = _npy(rng.standard_normal((1, E), dtype=np.float32))
        t = time.perf_counter()
        r = client.post(f"{base}/sessions/{sid}/append", content=body, headers=NPY)
        out.append(time.perf_counter() - t)
        r.raise_for_status()
    return out


def bench_sessions(base: str, n: int = 30) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    rows: dict[str, Any] = {}
    with httpx.Client(timeout=300) as client:
        short = _open(client, base, rng.standard_normal((16, E), dtype=np.float32))
        long = _open(client, base, rng.standard_normal((2048, E), dtype=np.float32))
        _appends(client, base, short, 3, rng), _appends(client, base, long, 3, rng)  # warm
        at16: list[float] = []
        at2048: list[float] = []
        for _ in range(n):  # interleaved, so a drift of the machine's load hits both alike
            at16 += _appends(client, base, short, 1, rng)
            at2048 += _appends(client, base, long, 1, rng)
        rows["append_ctx16_ms_p50"] = _p50(at16)
        rows["append_ctx2048_ms_p50"] = _p50(at2048)
        # Floors of the path: GET /sessions/{id} (HTTP + the handle call, no gang step) and a
        # one-row stateless /infer (HTTP + the data channel + a gang step).
        info, one_row = [], _npy(rng.standard_normal((1, 1, E), dtype=np.float32))
        infer = []
        for _ in range(n):
            t = time.perf_counter()
            client.get(f"{base}/sessions/{long}").raise_for_status()
            info.append(time.perf_counter() - t)
            t = time.perf_counter()
            client.post(f"{base}/infer", content=one_row, headers=NPY).raise_for_status()
            infer.append(time.perf_counter() - t)
        rows["get_session_ms_p50"] = _p50(info)
        rows["stateless_one_row_infer_ms_p50"] = _p50(infer)
        prefix = _npy(rng.standard_normal((1, 2049, E), dtype=np.float32))
        stateless, beside = [], []
        for _ in range(max(5, n // 3)):  # each beside an append at 2048 (the same load)
            t = time.perf_counter()
            client.post(f"{base}/infer", content=prefix, headers=NPY, params={"causal": "true"}).raise_for_status()
            stateless.append(time.perf_counter() - t)
            beside += _appends(client, base, long, 1, rng)
        rows["stateless_causal_2049_ms_p50"] = _p50(stateless)
        rows["append_ctx2048_beside_stateless_ms_p50"] = _p50(beside)
        sids = [_open(client, base, rng.standard_normal((8, E), dtype=np.float32)) for _ in range(32)]
        bodies = [_npy(rng.standard_normal((1, E), dtype=np.float32)) for _ in range(32)]

        def one(i: int) -> None:
            client.post(f"{base}/sessions/{sids[i]}/append", content=bodies[i], headers=NPY).raise_for_status()

        t = time.perf_counter()
        for _ in range(3):
            for i in range(32):
                one(i)
        rows["sequential_appends_per_s"] = round(96 / (time.perf_counter() - t), 1)
        before = client.get(f"{base}/gang").json()["sessions"]["batching"]
        t = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            for _ in range(3):
                list(pool.map(one, range(32)))
        rows["concurrent_appends_per_s"] = round(96 / (time.perf_counter() - t), 1)
        after = client.get(f"{base}/gang").json()["sessions"]["batching"]
        rows["concurrent_steps"] = after["steps"] - before["steps"]
        rows["concurrent_appends"] = after["appends"] - before["appends"]
    return rows


def print_sessions(rows: dict[str, Any]) -> dict[str, float]:
    print("\nsessions (world size 2, npy, p50 ms)")
    for key, value in rows.items():
        if key != "paged":
            print(f"  {key:34s} {value}")
    ratios = {
        "append ctx2048 / ctx16 (goal <= 2)": rows["append_ctx2048_ms_p50"] / rows["append_ctx16_ms_p50"],
        "stateless 2049 resend / append ctx2048 (goal >= 10)":
            rows["stateless_causal_2049_ms_p50"] / rows["append_ctx2048_beside_stateless_ms_p50"],
        "steps / appends at 32 sessions (goal <= 0.25)": rows["concurrent_steps"] / max(1, rows["concurrent_appends"]),
        "32 concurrent / one at a time, appends/s (goal >= 3)":
            rows["concurrent_appends_per_s"] / rows["sequential_appends_per_s"],
    }
    if "paged" in rows:  # issue 52 (bench.paged): gather vs in place, chunked prefill, cold start
        from bench.paged import print_paged

        ratios.update(print_paged(rows["paged"]))
    return {k: round(v, 3) for k, v in ratios.items()}


def append_vs_resend(base: str, dim: int, context: int = 2048, resends: int = 3, appends_each: int = 5,
                     warm_rows: int = 16) -> dict[str, Any]:
    """One-row appends to a session of `context` rows against the stateless alternative,
    `POST /infer?causal=true` of the whole `context + 1`-row sequence, on any model of width
    `dim` (the models section: the 12-layer stack). Every body is built before the first
    timed call (the client only sends). A small session first takes the rank's K/V pool
    allocation (made on the first append) out of the timed rows; each resend is followed by
    `appends_each` appends (the same load on both). The first append's row is the resent
    sequence's last: its output against the resend's last row is recorded (max_abs_diff)."""
    rng = np.random.default_rng(7)
    prefix = rng.standard_normal((context, dim), dtype=np.float32)
    rows = rng.standard_normal((resends * appends_each, dim), dtype=np.float32)
    whole = _npy(np.concatenate([prefix, rows[:1]])[None])  # [1, context + 1, dim]
    row_bodies = [_npy(r[None]) for r in rows]
    warm_prefill = _npy(rng.standard_normal((warm_rows, dim), dtype=np.float32))
    warm_rows_bodies = [_npy(r[None]) for r in rng.standard_normal((2, dim), dtype=np.float32)]
    prefill = _npy(prefix)
    out: dict[str, Any] = {"context": context, "dim": dim}
    with httpx.Client(timeout=600) as client:
        warm = client.post(f"{base}/sessions", content=warm_prefill, headers=NPY)
        warm.raise_for_status()
        for body in warm_rows_bodies:
            client.post(f"{base}/sessions/{warm.headers['x-session-id']}/append", content=body,
                        headers=NPY).raise_for_status()
        t = time.perf_counter()
        r = client.post(f"{base}/sessions", content=prefill, headers=NPY)
        out["open_ms"] = round((time.perf_counter() - t) * 1000, 1)
        r.raise_for_status()
        sid = r.headers["x-session-id"]
        resend_s, append_s = [], []
        first_append = first_resend = None
        for i in range(resends):
            t = time.perf_counter()
            r = client.post(f"{base}/infer", content=whole, headers=NPY, params={"causal": "true"})
            resend_s.append(time.perf_counter() - t)
            r.raise_for_status()
            if first_resend is None:
                first_resend = r.content
            for body in row_bodies[i * appends_each:(i + 1) * appends_each]:
                t = time.perf_counter()
                r = client.post(f"{base}/sessions/{sid}/append", content=body, headers=NPY)
                append_s.append(time.perf_counter() - t)
                r.raise_for_status()
                if first_append is None:
                    first_append = r.content
        client.delete(f"{base}/sessions/{sid}")
        client.delete(f"{base}/sessions/{warm.headers['x-session-id']}")
    # After the timed calls: the append's output row against the resend's last row.
    resent_last = np.load(io.BytesIO(first_resend)).reshape(-1, dim)[-1]
    appended = np.load(io.BytesIO(first_append)).reshape(-1, dim)[-1]
    out["max_abs_diff"] = float(np.abs(resent_last - appended).max())
    out["resend_ms"] = [round(s * 1000, 1) for s in resend_s]
    out["resend_ms_p50"] = _p50(resend_s)
    out["append_ms_p50"] = _p50(append_s)
    out["append_ms_p99"] = round(float(np.percentile(np.asarray(append_s) * 1000, 99)), 3)
    out["appends"] = len(append_s)
    out["speedup"] = round(out["resend_ms_p50"] / out["append_ms_p50"], 1)
    return out
