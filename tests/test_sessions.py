"""Stateful sessions with a sharded, paged KV cache (issue 31): real Ray, Serve, HTTP, gloo.

Every expected output is the dense reference's (harness/reference.py: torch
nn.MultiheadAttention with a causal mask over the session's whole concatenated sequence),
never the code under test's. The apps per world size are shared with tests/test_masks.py
(tests/shared_apps.py).
"""
from __future__ import annotations

import io
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import httpx
import numpy as np
import pytest
import torch

from service.parallel import ParallelGroup, TensorParallelAttention
from service.parallel.kv_cache import AppendPlan, PagedKVPool
from service.parallel.paged_kernel import InPlaceAttention
from service.parallel.weights import random_weights, shard_dense
from service.sessions.registry import Limits, SessionRegistry, StepItem
from tests.conftest import deploy, undeploy
from tests.shared_apps import E, SMALL_CACHE_TOKENS, WEIGHTS, WorldSizeApps, app_args
from tests.helpers import assert_error, eventually, npy_bytes, rand
from tests.session_client import TOL, HttpSession
from tests.reference import reference, relative_error



# ---------------------------------------------------------------- unit: the rank side's math

@pytest.mark.unit
@pytest.mark.parametrize("in_place", [False, True], ids=["gather", "in-place"])
def test_attention_append_matches_causal_mha_over_the_whole_sequence(in_place: bool) -> None:
    """Two sessions of different lengths interleaved in one pool, prefill then decode and
    multi-row appends, each step's rows equal to causal MHA's rows over the session so far;
    with the pool gathered (the fallback) and its one-row appends read in place (the C++ kernel)."""
    w = random_weights(64, 3)
    model = TensorParallelAttention(64, 4, ParallelGroup.single())
    model.load_shard(shard_dense(w, 0, 1))
    pool = PagedKVPool(16, 4, 4, 16, torch.float32, torch.device("cpu"))
    if in_place:
        pool.attention = InPlaceAttention(16, 4, 4, 4, 16, torch.float32)
    rng = np.random.default_rng(0)
    seqs = [np.zeros((0, 64), np.float32), np.zeros((0, 64), np.float32)]
    tables: list[list[int]] = [[], []]
    free = list(range(16))[::-1]
    for step in range(6):
        # a 21-row prefill and an 18-row append beside one-row appends: both paths in one step
        new = [rng.standard_normal((21 if step == 0 else 1, 64), dtype=np.float32),
               rng.standard_normal((18 if step == 3 else 3 if step % 2 else 1, 64), dtype=np.float32)]
        for s in (0, 1):
            while len(tables[s]) * 4 < len(seqs[s]) + len(new[s]):
                tables[s].append(free.pop())
        plan = AppendPlan(16, 4, tuple(len(n) for n in new), tuple(len(q) for q in seqs), tuple(map(tuple, tables)))
        plan.check()
        plan = AppendPlan.decode(plan.encode())
        with torch.inference_mode():
            out = model.append(torch.from_numpy(np.concatenate(new)), plan, pool)
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
    with pytest.raises(Exception) as unknown:  # not an id this app issued (tests/test_session_answers.py)
        reg.lookup("gangB-0123")
    assert getattr(unknown.value, "code", None) == "session_not_found"


# ---------------------------------------------------------------- the served apps

@pytest.fixture
def apps(world_size_apps: WorldSizeApps) -> Callable[[int], str]:
    """world size -> the base URL of its shared app (tests/shared_apps.py)."""
    return world_size_apps.get


def gang(base: str) -> dict:
    r = httpx.get(base + "/gang", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.ray
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_interleaved_sessions_match_causal_mha(apps: Callable[[int], str], ws: int) -> None:
    base = apps(ws)
    a = HttpSession(base, WEIGHTS, prefill=rand(7, E, seed=1))
    b = HttpSession(base, WEIGHTS)
    c = HttpSession(base, WEIGHTS, prefill=rand(1, 1, E, seed=2)[0])
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
    assert doc["session"]["length"] == len(b.seq) == doc["length"] and doc["shape"] == [1, 2, E]
    assert doc["session_id"] == b.id and doc["weights_version"] >= 1
    assert httpx.delete(f"{base}/sessions/{a.id}", timeout=30).status_code == 200
    assert_error(httpx.get(f"{base}/sessions/{a.id}", timeout=30), 404, "session_not_found")
    # the path these answers came from: the product's default, the decode kernel in place
    attention = gang(base)["sessions"]["attention"]
    assert (attention["path"], attention["compiled_shapes"]) == ("in_place", 1), attention


@pytest.mark.ray
def test_bad_input_is_refused_and_changes_nothing(apps: Callable[[int], str]) -> None:
    base = apps(2)
    s = HttpSession(base, WEIGHTS, prefill=rand(3, E, seed=4))
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
                            timeout=30), 404, "session_not_found")  # never issued: not a lost gang's
    gid = gang(base)["replica_id"]
    assert_error(httpx.post(f"{base}/sessions/{gid}-0123/append", content=npy_bytes(rand(1, E)), headers=npy,
                            timeout=30), 404, "session_not_found")
    assert s.info()["length"] == 3  # nothing above changed the session
    assert s.append(rand(2, E, seed=5), length=3).status_code == 200  # and it still answers right


@pytest.mark.ray
def test_concurrent_sessions_share_steps(apps: Callable[[int], str]) -> None:
    """32 sessions appending one row each at once: their appends share gang steps (each with
    its own context length), and every answer is right. How many share a step depends on how
    close together 32 HTTP requests reach rank 0 on a loaded machine (8-25 steps for 96 appends
    here): the test asks for sharing beyond doubt (at most one step per two appends, one step of
    four or more sessions); the goal of one step per four appends is a bench row
    (`bench/run.py --only sessions`)."""
    base = apps(2)
    sessions = [HttpSession(base, WEIGHTS, prefill=rand(2 + i % 5, E, seed=300 + i)) for i in range(32)]
    before = gang(base)["sessions"]["batching"]
    rounds = 3
    with ThreadPoolExecutor(32) as pool:
        for r in range(rounds):
            replies = list(pool.map(lambda s: s.append(rand(1, E, seed=len(s.seq) * 7 + hash(s.id) % 1000)),
                                    sessions))
            assert all(x.status_code == 200 for x in replies), [x.text for x in replies if x.status_code != 200]
    after = gang(base)["sessions"]["batching"]
    steps, appends = after["steps"] - before["steps"], after["appends"] - before["appends"]
    print(f"32 sessions x {rounds} appends: {appends} appends in {steps} steps")
    assert appends == 32 * rounds
    assert steps <= appends / 2, (steps, appends)
    assert after["max_sessions_in_a_step"] >= 4, after


@pytest.mark.ray
def test_cache_bytes_per_token_and_gang_report(apps: Callable[[int], str]) -> None:
    """Bytes per cached token per rank = 2 * (E / ws) * 4 (float32) plus at most 10% layout
    overhead, as /gang and GET /sessions/{id} report; the pool is what the budget says."""
    base = apps(2)
    s = HttpSession(base, WEIGHTS, prefill=rand(200, E, seed=11))
    formula = 2 * (E // 2) * 4
    report = gang(base)["sessions"]
    assert report["bytes_per_token_per_rank"] == formula
    assert report["per_rank"][0]["allocated_bytes"] == report["capacity_bytes_per_rank"]
    assert report["capacity_bytes_per_rank"] <= 64 * 1024 * 1024
    assert len(report["per_rank"]) == 2 and report["active"] >= 1
    info = s.info()
    assert info["kv_bytes_per_rank"] / info["length"] <= 1.1 * formula, info
    assert report["used_bytes_per_rank"] >= info["kv_bytes_per_rank"]
    text = httpx.get(base + "/metrics", timeout=30).text
    assert "gangserve_sessions_active" in text and "gangserve_session_cache_bytes" in text
    # The attention reads the pool in place, compiled at bring-up (its own stage, before ready),
    # and long appends are chunked (issue 52).
    attention = report["attention"]
    assert attention["path"] == "in_place", attention
    assert attention["compiled_shapes"] >= 1 and attention["prefill_chunk_tokens"] == 256, attention
    assert "compile" in gang(base)["last_bring_up"]["ms"]


@pytest.mark.ray
def test_eviction_recomputes_and_stays_right(apps: Callable[[int], str]) -> None:
    """The cache holds 1024 tokens: a second 600-token session evicts the first (LRU), whose
    next append is recomputed from its kept inputs (counted) and still exact."""
    base = apps(1)
    a = HttpSession(base, WEIGHTS, prefill=rand(600, E, seed=21))
    before = gang(base)["sessions"]
    b = HttpSession(base, WEIGHTS, prefill=rand(600, E, seed=22))
    mid = gang(base)["sessions"]
    assert mid["evictions"] > before["evictions"]
    assert a.info()["cached_tokens"] == 0
    r = a.append(rand(1, E, seed=23))
    assert r.status_code == 200, r.text
    assert int(r.headers["x-recomputed-tokens"]) == 600
    after = gang(base)["sessions"]
    assert after["recomputed_tokens"] - mid["recomputed_tokens"] >= 600
    assert b.append(rand(2, E, seed=24)).status_code == 200  # b was evicted in turn: right again
    # a session longer than the whole cache can never be held: 507, nothing appended
    c = HttpSession(base, WEIGHTS)
    doc = assert_error(c.append(rand(SMALL_CACHE_TOKENS + 16, E, seed=25)), 507, "session_cache_full")
    assert "blocks" in doc["error"]
    assert c.info()["length"] == 0


@pytest.mark.ray
def test_idle_session_expires_distinct_from_unknown(apps: Callable[[int], str]) -> None:
    base = apps(1)
    s = HttpSession(base, WEIGHTS, prefill=rand(2, E, seed=31))
    doc = eventually(lambda: httpx.get(f"{base}/sessions/{s.id}", timeout=10).json().get("code") == "session_expired"
                     and True, 30, "the idle session to expire")
    assert doc
    r = s.append(rand(1, E))
    assert_error(r, 404, "session_expired")
    assert_error(httpx.delete(f"{base}/sessions/{s.id}", timeout=10), 404, "session_expired")
    gid = gang(base)["replica_id"]
    assert_error(httpx.get(f"{base}/sessions/{gid}-ffff", timeout=10), 404, "session_not_found")


@pytest.mark.ray
def test_weights_swap_recomputes_under_the_new_version(apps: Callable[[int], str]) -> None:
    """A session computed with version V answers, after a swap to V+1, with V+1 named and the
    rows of the new weights over its whole sequence (recomputed): never a mix."""
    from service.parallel.weights import save_checkpoint
    from service.state.paths import state_dir
    from tests.helpers import AUTH

    base = apps(2)
    s = HttpSession(base, WEIGHTS, prefill=rand(9, E, seed=51))
    old = int(s.append(rand(1, E, seed=52)).headers["x-weights-version"])
    new_weights = random_weights(512, 77)
    rel = "checkpoints/sessions-swap-77.safetensors"
    path = state_dir() / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, new_weights, 8)
    swap = httpx.post(base + "/weights", json={"checkpoint": rel}, headers=AUTH, timeout=330)
    assert swap.status_code == 200, swap.text
    rows = rand(2, E, seed=53)
    r = httpx.post(f"{base}/sessions/{s.id}/append", content=npy_bytes(rows),
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200, r.text
    assert int(r.headers["x-weights-version"]) > old
    assert int(r.headers["x-recomputed-tokens"]) == len(s.seq)
    seq = np.concatenate([s.seq, rows])
    want = reference(seq, causal=True, weights=new_weights)[-2:]
    assert relative_error(torch.from_numpy(np.load(io.BytesIO(r.content))), want) <= TOL
    assert s.info()["weights_version"] == int(r.headers["x-weights-version"])


@pytest.mark.ray
def test_stock_tritonclient_drives_a_sequence(apps: Callable[[int], str]) -> None:
    """tritonclient's own request for infer(sequence_id=, sequence_start=, sequence_end=)
    drives a session: start opens it, every request appends, end ends it."""
    base = apps(1)
    seq = np.zeros((0, E), np.float32)
    for i, (n, start, end) in enumerate(((3, True, False), (1, False, False), (2, False, True))):
        rows = rand(1, n, E, seed=600 + i)
        result = _infer_at(base, rows, 4242, start, end)
        seq = np.concatenate([seq, rows[0]])
        want = reference(seq, causal=True, weights=WEIGHTS)[-n:]
        assert relative_error(torch.from_numpy(np.asarray(result)).reshape(n, E), want) <= TOL, i
    with pytest.raises(AssertionError, match="session_not_found"):  # ended by sequence_end
        _infer_at(base, rand(1, 1, E), 4242, False, False)
    _infer_at(base, rand(1, 1, E), 4243, True, False)
    with pytest.raises(AssertionError, match="session_exists"):  # start on a live id
        _infer_at(base, rand(1, 1, E), 4243, True, False)


def _infer_at(base: str, rows: np.ndarray, seq_id: int, start: bool, end: bool) -> np.ndarray:
    """tritonclient's own request body (InferenceServerClient.generate_request_body, the bytes
    its infer() sends), POSTed to the app under its route prefix (tritonclient's client takes
    no path prefix); the output through tritonclient's own InferResult."""
    import tritonclient.http as triton

    inp = triton.InferInput("hidden_states", list(rows.shape), "FP32").set_data_from_numpy(rows)
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [inp], sequence_id=seq_id, sequence_start=start, sequence_end=end)
    headers = {"content-type": "application/octet-stream"}
    if header_length is not None:
        headers["Inference-Header-Content-Length"] = str(header_length)
    r = httpx.post(f"{base}/v2/models/attention/infer", content=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    length = r.headers.get("Inference-Header-Content-Length")
    result = triton.InferResult.from_response_body(r.content, header_length=int(length) if length else None)
    return result.as_numpy("output")


@pytest.mark.ray
def test_python_client_session_object(apps: Callable[[int], str]) -> None:
    from gangserve_client import GangServeClient

    base = apps(1)
    prompt = rand(5, E, seed=700)
    with GangServeClient(base) as client:
        with client.session(prefill=prompt) as s:
            seq = prompt
            assert relative_error(torch.from_numpy(np.asarray(s.prefill_output)),
                                  reference(seq, causal=True, weights=WEIGHTS)) <= TOL
            for i in range(3):
                row = rand(1, E, seed=701 + i)
                out = s.append(row, fmt="npy" if i % 2 else "safetensors")
                seq = np.concatenate([seq, row])
                assert relative_error(torch.from_numpy(np.asarray(out)),
                                      reference(seq, causal=True, weights=WEIGHTS)[-1:]) <= TOL
            assert s.length == 8 and s.weights_version >= 1
            assert s.refresh()["length"] == 8
            sid = s.id
        assert_error(httpx.get(f"{base}/sessions/{sid}", timeout=30), 404, "session_not_found")  # ended on exit


@pytest.fixture(scope="module")
def two_gangs(serve_url: str) -> Iterator[str]:
    """Two gangs of world size 1 (num_replicas: 2): two GangServer replicas."""

    base = deploy(serve_url, "sessions-gangs", "/sessions-gangs",
                  app_args(1, num_replicas=2, data_channel=False))
    eventually(lambda: httpx.get(base + "/gangs", timeout=10).json().get("ready") == 2, 120, "both gangs ready")
    yield base
    undeploy("sessions-gangs")


@pytest.mark.ray
def test_several_gangs_affinity_then_rank0_loss_answers_410(two_gangs: str) -> None:
    """Sessions opened on either gang keep answering right (each call reaches the gang that
    holds it); kill -9 of one gang's rank 0 (its GangServer replica) makes its sessions answer
    410 session_lost, while the other gang's sessions go on."""
    base = two_gangs
    sessions = [HttpSession(base, WEIGHTS, prefill=rand(3, E, seed=800 + i)) for i in range(8)]
    owners = {s.id.rsplit("-", 1)[0] for s in sessions}
    if len(owners) < 2:  # the router's random choice put all 8 on one gang: open more
        sessions += [HttpSession(base, WEIGHTS, prefill=rand(3, E, seed=900 + i)) for i in range(16)]
        owners = {s.id.rsplit("-", 1)[0] for s in sessions}
    assert len(owners) == 2, owners
    for _ in range(3):
        for s in sessions:
            assert s.append(rand(1, E, seed=len(s.seq))).status_code == 200
    gangs = httpx.get(base + "/gangs", timeout=30).json()["gangs"]
    victim = gangs[0]
    lost_owner, victim_pid = victim["replica_id"], victim["ranks"][0]["pid"]
    os.kill(victim_pid, signal.SIGKILL)
    for s in sessions:
        if s.id.startswith(lost_owner + "-"):
            doc = eventually(lambda: (r := s.append(rand(1, E))).status_code == 410 and r.json(), 120,
                             f"session {s.id} of the lost gang answering 410")
            assert doc["code"] == "session_lost" and lost_owner in doc["error"]
        else:
            r = s.append(rand(1, E, seed=len(s.seq)))
            assert r.status_code == 200, r.text
