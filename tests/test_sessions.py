"""Stateful sessions with a sharded, paged KV cache (issue 31): real Ray, Serve, HTTP, gloo.

Every expected output is the dense reference's (harness/reference.py: torch
nn.MultiheadAttention with a causal mask over the session's whole concatenated sequence),
never the code under test's. Apps are this module's own (random weights: the softmax is far
from one-hot), one per world size, deployed on first use.
"""
from __future__ import annotations

import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import pytest
import torch

from service.parallel import ParallelGroup, TensorParallelAttention
from service.parallel.kv_cache import AppendPlan, PagedKVPool, append_attention
from service.parallel.weights import random_weights, shard_dense
from service.sessions.registry import Limits, SessionRegistry, StepItem
from tests.conftest import deploy, local_yaml_args
from tests.helpers import assert_error, eventually, npy_bytes, rand
from tests.reference import reference, relative_error

SEED = 5
WEIGHTS = random_weights(512, SEED)
TOL = 1e-5
E = 512


# ---------------------------------------------------------------- unit: the rank side's math

@pytest.mark.unit
def test_append_attention_matches_causal_mha_over_the_whole_sequence() -> None:
    """Two sessions of different lengths interleaved in one pool, prefill then decode and
    multi-row appends, each step's rows equal to causal MHA's rows over the session so far."""
    w = random_weights(64, 3)
    model = TensorParallelAttention(64, 4, ParallelGroup.single())
    model.load_shard(shard_dense(w, 0, 1))
    pool = PagedKVPool(16, 4, 4, 16, torch.float32, torch.device("cpu"))
    rng = np.random.default_rng(0)
    seqs = [np.zeros((0, 64), np.float32), np.zeros((0, 64), np.float32)]
    tables: list[list[int]] = [[], []]
    free = list(range(16))[::-1]
    for step in range(6):
        new = [rng.standard_normal((5 if step == 0 else 1, 64), dtype=np.float32),
               rng.standard_normal((3 if step % 2 else 1, 64), dtype=np.float32)]
        for s in (0, 1):
            while len(tables[s]) * 4 < len(seqs[s]) + len(new[s]):
                tables[s].append(free.pop())
        plan = AppendPlan(16, 4, tuple(len(n) for n in new), tuple(len(q) for q in seqs), tuple(map(tuple, tables)))
        plan.check()
        plan = AppendPlan.decode(plan.encode())
        with torch.inference_mode():
            out = append_attention(model, pool, torch.from_numpy(np.concatenate(new)), plan)
        at = 0
        for s in (0, 1):
            seqs[s] = np.concatenate([seqs[s], new[s]])
            want = reference(seqs[s], causal=True, weights=w, num_heads=4)[-len(new[s]):]
            assert relative_error(out[at:at + len(new[s])], want) <= TOL, (step, s)
            at += len(new[s])


@pytest.mark.unit
def test_registry_evicts_least_recently_used_and_plans_a_recompute() -> None:
    reg = SessionRegistry(Limits(num_blocks=4, block_size=4, max_sessions=8, max_session_tokens=64,
                                 idle_timeout_s=60, bytes_per_token=8), owner="gangA")
    a, b, c = reg.open(), reg.open(), reg.open()
    for s in (a, b):  # 8 tokens each: two blocks each, the pool is full
        step = reg.plan([StepItem(s, np.ones((8, 2), np.float32))], generation=1, version=1)
        step.commit(np.zeros((8, 2), np.float32))
    assert reg.stats()["free_blocks"] == 0
    step = reg.plan([StepItem(c, np.ones((1, 2), np.float32))], generation=1, version=1)  # evicts a (LRU)
    step.commit(np.zeros((1, 2), np.float32))
    assert (a.blocks, a.cached, reg.evictions) == ([], 0, 1) and len(b.blocks) == 2
    step = reg.plan([StepItem(a, np.ones((1, 2), np.float32))], generation=1, version=1)  # recomputes a
    assert step.items[0].recompute and step.plan.cached == (0,) and step.plan.new_rows == (9,)
    assert step.x.shape == (9, 2)
    results = step.commit(np.arange(18, dtype=np.float32).reshape(9, 2))
    assert results[0][0].tolist() == [[16.0, 17.0]] and reg.recomputed_tokens == 8
    # a new generation (a rebuilt gang) or weights version recomputes without any eviction
    step = reg.plan([StepItem(b, np.ones((1, 2), np.float32))], generation=2, version=1)
    assert step.items[0].recompute and step.plan.cached == (0,)
    step.abort()
    with pytest.raises(Exception) as lost:
        reg.lookup("gangB-0123")
    assert getattr(lost.value, "code", None) == "session_lost"


# ---------------------------------------------------------------- the served apps

pytestmark_ray = [pytest.mark.ray]


def app_args(world_size: int, **extra: object) -> dict:
    return {**local_yaml_args(), "init": "random", "seed": SEED, "world_size": world_size,
            "cpus_per_rank": 0.25, "session_block_tokens": 16, **extra}


EXTRA_ARGS: dict[int, dict] = {1: {}, 2: {}}


@pytest.fixture(scope="module")
def apps(serve_url: str) -> Iterator[Callable[[int], str]]:
    from ray import serve

    deployed: dict[int, str] = {}

    def get(ws: int) -> str:
        if ws not in deployed:
            deployed[ws] = deploy(serve_url, f"sessions-ws{ws}", f"/sessions-ws{ws}", app_args(ws, **EXTRA_ARGS[ws]))
        return deployed[ws]

    yield get
    for ws in deployed:
        serve.delete(f"sessions-ws{ws}")


class Client:
    """A session driven over HTTP (npy bodies), with the expected outputs tracked."""

    def __init__(self, base: str, prefill: np.ndarray | None = None) -> None:
        self.base = base
        self.seq = np.zeros((0, E), np.float32)
        if prefill is None:
            r = httpx.post(f"{base}/sessions", timeout=60)
            assert r.status_code == 201, r.text
            self.id = r.json()["session_id"]
        else:
            r = httpx.post(f"{base}/sessions", content=npy_bytes(prefill),
                           headers={"content-type": "application/x-npy"}, timeout=60)
            assert r.status_code == 201, r.text
            self.id = r.headers["x-session-id"]
            self.check(prefill, r)

    def append(self, rows: np.ndarray, **params: Any) -> httpx.Response:
        r = httpx.post(f"{self.base}/sessions/{self.id}/append", content=npy_bytes(rows), params=params,
                       headers={"content-type": "application/x-npy"}, timeout=60)
        if r.status_code == 200:
            self.check(rows, r)
        return r

    def check(self, rows: np.ndarray, r: httpx.Response) -> None:
        self.seq = np.concatenate([self.seq, rows])
        out = np.load(io.BytesIO(r.content))
        assert out.shape == rows.shape, (out.shape, rows.shape)
        want = reference(self.seq, causal=True, weights=WEIGHTS)[-len(rows):]
        err = relative_error(torch.from_numpy(out), want)
        assert err <= TOL, f"session {self.id} at length {len(self.seq)}: relative error {err:.3e}"
        assert int(r.headers["x-session-length"]) == len(self.seq)
        assert r.headers["x-weights-version"].isdigit()

    def info(self) -> dict:
        r = httpx.get(f"{self.base}/sessions/{self.id}", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()


def gang(base: str) -> dict:
    r = httpx.get(base + "/gang", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.ray
@pytest.mark.parametrize("ws", [1, 2])
def test_interleaved_sessions_match_causal_mha(apps: Callable[[int], str], ws: int) -> None:
    base = apps(ws)
    a = Client(base, prefill=rand(7, E, seed=1))
    b = Client(base)
    c = Client(base, prefill=rand(1, 1, E, seed=2)[0])
    for i in range(5):
        for s, n in ((a, 1), (b, 3 if i % 2 else 1), (c, 20 if i == 2 else 1)):
            r = s.append(rand(n, E, seed=100 * i + n + len(s.seq)))
            assert r.status_code == 200, r.text
    info = a.info()
    assert info["length"] == 12 and info["weights_version"] >= 1 and info["kv_bytes_per_rank"] > 0
    # [1, n, E] bodies and JSON replies work too
    rows = rand(1, 2, E, seed=9)
    r = httpx.post(f"{base}/sessions/{b.id}/append", json={"hidden_states": rows.tolist()}, timeout=60)
    assert r.status_code == 200, r.text
    doc = r.json()
    b.seq = np.concatenate([b.seq, rows[0]])
    want = reference(b.seq, causal=True, weights=WEIGHTS)[-2:]
    assert relative_error(torch.tensor(doc["output"]).reshape(2, E), want) <= TOL
    assert doc["session"]["length"] == len(b.seq) and doc["shape"] == [1, 2, E]
    assert httpx.delete(f"{base}/sessions/{a.id}", timeout=30).status_code == 200
    assert_error(httpx.get(f"{base}/sessions/{a.id}", timeout=30), 404, "session_not_found")


@pytest.mark.ray
def test_bad_input_is_refused_and_changes_nothing(apps: Callable[[int], str]) -> None:
    base = apps(2)
    s = Client(base, prefill=rand(3, E, seed=4))
    url = f"{base}/sessions/{s.id}/append"
    npy = {"content-type": "application/x-npy"}
    doc = assert_error(httpx.post(url, content=npy_bytes(rand(2, E - 1)), headers=npy, timeout=30), 422, "invalid_input")
    assert str(E) in doc["error"]
    assert_error(httpx.post(url, json={"hidden_states": rand(2, E).tolist(), "attention_mask": [1, 1]}, timeout=30),
                 422, "invalid_input")
    assert_error(httpx.post(url, content=npy_bytes(rand(2, 2, E)), headers=npy, timeout=30), 422, "invalid_input")
    long = rand(4096, E)  # max_session_tokens defaults to 4096: 3 + 4096 is past it
    doc = assert_error(httpx.post(url, content=npy_bytes(long), headers=npy, timeout=60), 422, "session_too_long")
    assert "4096" in doc["error"]
    assert_error(httpx.post(url, content=b"not npy", headers=npy, timeout=30), 400)
    assert_error(s.append(rand(1, E), length=99), 409, "session_length_mismatch")
    assert_error(httpx.post(f"{base}/sessions/nosuch-0123/append", content=npy_bytes(rand(1, E)), headers=npy,
                            timeout=30), 410, "session_lost")
    gid = gang(base)["replica_id"]
    assert_error(httpx.post(f"{base}/sessions/{gid}-0123/append", content=npy_bytes(rand(1, E)), headers=npy,
                            timeout=30), 404, "session_not_found")
    assert s.info()["length"] == 3  # nothing above changed the session
    assert s.append(rand(2, E, seed=5), length=3).status_code == 200  # and it still answers right
