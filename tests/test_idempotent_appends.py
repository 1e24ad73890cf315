"""Exactly-once session appends (issue 52, item 1): idempotency keys.

Unit tests: the key rule and the rows' digest (service.sessions.keys), and the registry's
memory of keys (service.sessions.registry: the bound, eviction, reuse for other rows, claims
in flight, withdrawn claims), on a real SessionRegistry driven as the gang drives it (plan,
then commit or abort), with the sequencer's side on a real thread where it matters.

Served tests, on the `make serve` app (world size 2, the data channel its route): real Ray,
Serve, HTTP and gloo. A failpoint in rank 0's process (service.gang.failpoints.SESSION_APPEND)
loses a committed append's answer; the retry must get the first answer (`Idempotent-Replayed:
true`), the session must have grown once, and the later appends must still equal the dense
causal reference (tests/reference.py: torch's nn.MultiheadAttention in float64 over the whole
sequence), which they would not if the rows had gone in twice.
"""
from __future__ import annotations

import asyncio
import io
import threading
import time
import uuid

import httpx
import numpy as np
import pytest
import torch

from service.contract.errors import Conflict, InvalidInput
from service.gang import failpoints
from service.sessions import keys
from service.sessions.registry import ClaimState, Limits, SessionRegistry, StepItem
from tests.helpers import assert_error, npy_bytes, rand
from tests.reference import reference, relative_error
from tests.session_client import TOL, E, HttpSession

APP = "gangserve"  # the app of `app_url` (tests/conftest.py)
NPY = {"content-type": "application/x-npy"}


# ---------------------------------------------------------------- unit: keys and digests

@pytest.mark.unit
def test_a_key_is_1_to_128_visible_ascii_characters() -> None:
    assert keys.key_of(None, "Idempotency-Key") is None
    uid = str(uuid.uuid4())
    assert keys.key_of(uid, "Idempotency-Key") == uid
    assert keys.key_of(f'"{uid}"', "Idempotency-Key") == uid  # the IETF draft's sf-string form
    assert keys.key_of("!" * 128, "h") == "!" * 128 and keys.key_of("~", "h") == "~"
    assert len(keys.new_key()) == 32 and keys.new_key() != keys.new_key()
    for bad, why in (("", "empty"), ('""', "empty"), ("x" * 129, "129 characters long"),
                     ("a b", "outside visible ASCII"), ("tab\there", "outside visible ASCII"),
                     ("clé", "outside visible ASCII"), (7, "int")):
        with pytest.raises(InvalidInput) as refused:
            keys.key_of(bad, "Idempotency-Key")
        assert refused.value.code == "invalid_request" and refused.value.status == 422
        assert why in refused.value.message and "Idempotency-Key" in refused.value.message, refused.value.message


@pytest.mark.unit
def test_the_digest_tells_rows_apart_by_bytes_shape_and_dtype() -> None:
    x = rand(2, 4, seed=1)
    same = np.array(x, copy=True)
    assert keys.rows_digest(x) == keys.rows_digest(same) == keys.rows_digest(np.asfortranarray(x))
    others = [x.reshape(4, 2), x.astype(np.float64), x + np.float32(1e-7) * (x == x.max()), x[:1]]
    digests = {keys.rows_digest(o) for o in others}
    assert keys.rows_digest(x) not in digests and len(digests) == len(others)


# ---------------------------------------------------------------- unit: the registry's memory

def registry(kept: int = 3) -> SessionRegistry:
    return SessionRegistry(Limits(num_blocks=16, block_size=4, max_sessions=8, max_session_tokens=64,
                                  idle_timeout_s=60, bytes_per_token=8, answers_kept=kept), owner="gangA")


def append(reg: SessionRegistry, session_id: str, key: str, x: np.ndarray) -> tuple[np.ndarray, dict]:
    """What SessionService.append does with a key, the step run at once: admit, plan, commit
    (the 'gang' computes y = 10 x); a retry gets the kept answer."""
    s = reg.lookup(session_id)
    admission = reg.admit(s, key, keys.rows_digest(x))
    if admission.kept is not None:
        return admission.kept.replay()
    assert admission.first and admission.claim is not None
    step = reg.plan([StepItem(s, x, claim=admission.claim)], generation=1, version=1)
    rows, info = step.commit(np.concatenate([s.kept(), x]) * 10 if step.items[0].recompute else x * 10)[0]
    reg.withdraw(admission.claim)  # as the service does when its call returns: a no-op now
    assert isinstance(info, dict)
    return rows, info


@pytest.mark.unit
def test_a_retried_key_replays_its_answer_and_appends_nothing() -> None:
    reg = registry()
    s = reg.open()
    x = rand(2, 2, seed=3)
    rows, info = append(reg, s.id, "k1", x)
    np.testing.assert_array_equal(rows, x * 10)
    assert info["length"] == 2 and "replayed" not in info
    again, info2 = append(reg, s.id, "k1", np.array(x, copy=True))
    np.testing.assert_array_equal(again, rows)
    assert info2 == {**info, "replayed": True}
    assert s.length == 2 and s.appends == 1 and reg.appends == 1 and len(s.inputs) == 1
    again[...] = 0  # the replay is the caller's own copy: the kept answer is unchanged
    np.testing.assert_array_equal(append(reg, s.id, "k1", x)[0], x * 10)
    public = reg.public(s)
    assert public["answers_kept"] == 1 and public["answer_bytes"] == x.nbytes


@pytest.mark.unit
def test_the_same_key_with_other_rows_is_409_and_changes_nothing() -> None:
    reg = registry()
    s, other = reg.open(), reg.open()
    x = rand(1, 2, seed=4)
    append(reg, s.id, "k", x)
    for rows in (rand(1, 2, seed=5), x.reshape(2, 1), x.astype(np.float64), rand(2, 2, seed=4)):
        with pytest.raises(Conflict) as refused:
            append(reg, s.id, "k", rows)
        assert refused.value.code == "idempotency_key_reused" and refused.value.status == 409
        assert "'k'" in refused.value.message and "Nothing was appended" in refused.value.message
    assert s.length == 1 and s.appends == 1
    append(reg, other.id, "k", rand(3, 2, seed=6))  # keys are per session: another session's is its own
    assert other.length == 3


@pytest.mark.unit
def test_a_session_remembers_its_last_n_keys_and_forgets_older_ones() -> None:
    reg = registry(kept=3)
    s = reg.open()
    xs = [rand(1, 2, seed=10 + i) for i in range(5)]
    for i, x in enumerate(xs):
        append(reg, s.id, f"k{i}", x)
    assert list(s.answers) == ["k2", "k3", "k4"] and s.length == 5
    np.testing.assert_array_equal(append(reg, s.id, "k2", xs[2])[0], xs[2] * 10)  # remembered: no append
    assert s.length == 5
    append(reg, s.id, "k0", xs[0])  # forgotten: appended again (why ?length= stays in the client)
    assert s.length == 6 and list(s.answers) == ["k3", "k4", "k0"]
    reg.close(s.id)
    assert len(s.answers) == 0  # an ended session's answers are freed with it
    with pytest.raises(ValueError, match="session_answers_kept >= 1"):
        registry(kept=0)


@pytest.mark.unit
def test_a_key_in_flight_is_its_first_try_s_claim_and_a_waiter_wakes_at_its_commit() -> None:
    """A retry arriving while the first try's step runs gets the first's claim (not a claim of
    its own), waits, and finds the answer once the sequencer's thread commits the step."""
    reg = registry()
    s = reg.open()
    x = rand(1, 2, seed=20)
    first = reg.admit(s, "k", keys.rows_digest(x))
    assert first.first and first.claim is not None and first.claim.state is ClaimState.WAITING
    step = reg.plan([StepItem(s, x, claim=first.claim)], generation=1, version=1)
    assert first.claim.state is ClaimState.PLANNED
    retry = reg.admit(s, "k", keys.rows_digest(x))
    assert not retry.first and retry.claim is first.claim and retry.kept is None
    with pytest.raises(Conflict, match="is being appended"):
        reg.admit(s, "k", keys.rows_digest(x + 1))
    reg.withdraw(first.claim)  # its caller went away while it runs: the step still settles it
    assert first.claim.state is ClaimState.PLANNED

    async def wait_for_the_commit() -> bool:
        thread = threading.Thread(target=lambda: (time.sleep(0.2), step.commit(x * 10)))
        thread.start()
        try:
            return await reg.settled(retry.claim, until=time.monotonic() + 30)
        finally:
            thread.join(30)

    assert asyncio.run(wait_for_the_commit())
    assert first.claim.state is ClaimState.SETTLED and first.claim.appended
    after = reg.admit(s, "k", keys.rows_digest(x))
    assert after.kept is not None and s.length == 1 and "k" not in s.claims
    np.testing.assert_array_equal(after.kept.replay()[0], x * 10)


@pytest.mark.unit
def test_a_claim_withdrawn_before_its_step_is_never_appended_and_frees_its_key() -> None:
    reg = registry()
    s = reg.open()
    x = rand(1, 2, seed=30)
    first = reg.admit(s, "k", keys.rows_digest(x))
    assert first.claim is not None
    reg.withdraw(first.claim)  # e.g. its deadline passed while queued, or its caller went away
    assert first.claim.state is ClaimState.SETTLED and not first.claim.appended
    step = reg.plan([StepItem(s, x, claim=first.claim)], generation=1, version=1)  # a late plan skips it
    results = step.commit(np.zeros((0, 2), np.float32))
    assert results[0][0] is None and "withdrawn" in str(results[0][1]) and s.length == 0
    second = reg.admit(s, "k", keys.rows_digest(x))  # the retry runs as the first now
    assert second.first and second.claim is not first.claim

    async def timed_out_wait() -> bool:  # a wait is bounded: nobody settles `second` here
        return await reg.settled(second.claim, until=time.monotonic() + 0.1)

    assert asyncio.run(timed_out_wait()) is False


@pytest.mark.unit
def test_an_aborted_step_or_a_refused_plan_settles_its_claims_as_not_appended() -> None:
    reg = registry()
    s = reg.open()
    x = rand(1, 2, seed=40)
    a = reg.admit(s, "a", keys.rows_digest(x)).claim
    assert a is not None
    step = reg.plan([StepItem(s, x, claim=a)], generation=1, version=1)
    step.abort()  # the gang broke during the step
    assert a.state is ClaimState.SETTLED and not a.appended and s.length == 0 and "a" not in s.claims
    b = reg.admit(s, "b", keys.rows_digest(x)).claim
    assert b is not None
    step = reg.plan([StepItem(s, x, expect_length=5, claim=b)], generation=1, version=1)  # ?length= fails
    assert "session_length_mismatch" in str(step.items[0].error.code)
    assert b.state is ClaimState.SETTLED and not b.appended
    big = rand(17 * 4, 2, seed=41)  # more blocks than the pool holds: the plan itself raises
    c = reg.admit(s, "c", keys.rows_digest(big)).claim
    assert c is not None
    with pytest.raises(Exception, match="blocks"):
        reg.plan([StepItem(s, big, claim=c)], generation=1, version=1)
    assert c.state is ClaimState.SETTLED and not c.appended and s.claims == {}


# ---------------------------------------------------------------- served: a real gang

def arm(name: str) -> None:
    """Arm one of rank 0's session-append failpoints on the app's gang server."""
    from ray import serve

    assert name in failpoints.SESSION_APPEND
    serve.get_deployment_handle("GangServer", app_name=APP).arm_session_failpoint.remote(name).result(timeout_s=60)


def transport(base: str) -> dict:
    r = httpx.get(base + "/gang", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["ingress_transport"]


def output(r: httpx.Response) -> np.ndarray:
    return np.load(io.BytesIO(r.content))


def retry_is_a_replay(s: HttpSession, first: httpx.Response, rows: np.ndarray, key: str) -> None:
    """A client's own retry of `first` (the same key and rows) answers `first` again, byte for
    byte, and the session's length stays."""
    again = httpx.post(f"{s.base}/sessions/{s.id}/append", content=npy_bytes(rows), headers={**NPY,
                       keys.HEADER: key}, timeout=60)
    assert again.status_code == 200, again.text
    assert again.headers[keys.REPLAYED_HEADER.lower()] == "true"
    np.testing.assert_array_equal(output(again), output(first))
    assert again.headers["x-session-length"] == first.headers["x-session-length"] == str(len(s.seq))
    assert s.info()["length"] == len(s.seq)


@pytest.mark.ray
def test_a_reply_dropped_after_the_commit_is_answered_once_through_the_fallback(app_url: str) -> None:
    """The data channel closes after the gang server committed the append: the ingress falls
    back to the handle call with the same key and gets the kept answer (replayed); the session
    grew once, and the appends after it are still the causal reference's rows."""
    s = HttpSession(app_url, None, prefill=rand(5, E, seed=101))
    assert s.append(rand(1, E, seed=102)).status_code == 200  # the route is chosen (the channel)
    before = transport(app_url)
    arm("session_append_reply_dropped")
    rows, key = rand(2, E, seed=103), str(uuid.uuid4())
    r = s.append(rows, key=key)  # checked against the reference; its length is 5 + 1 + 2
    assert r.status_code == 200, r.text
    assert r.headers[keys.REPLAYED_HEADER.lower()] == "true"  # the first try was committed; this is its answer
    after = transport(app_url)
    assert after["data_channel_fallbacks"] == before["data_channel_fallbacks"] + 1, (before, after)
    retry_is_a_replay(s, r, rows, key)
    for i in range(3):  # later appends: right only if the rows went in once
        nxt = s.append(rand(1 + i, E, seed=104 + i), key=str(uuid.uuid4()))
        assert nxt.status_code == 200 and keys.REPLAYED_HEADER.lower() not in nxt.headers, nxt.text
    assert s.info()["length"] == 5 + 1 + 2 + 6


@pytest.mark.ray
def test_an_answer_lost_after_the_commit_is_answered_once_by_the_policy_s_retry(app_url: str) -> None:
    """The gang server answers a retryable 503 after committing the append (no key sent: the
    ingress makes one); the request policy retries with that key and gets the kept answer."""
    s = HttpSession(app_url, None, prefill=rand(3, E, seed=201))
    arm("session_append_answer_lost")
    r = s.append(rand(1, E, seed=202))
    assert r.status_code == 200, r.text
    assert r.headers[keys.REPLAYED_HEADER.lower()] == "true"
    assert s.append(rand(2, E, seed=203)).status_code == 200
    assert s.info()["length"] == 3 + 1 + 2


@pytest.mark.ray
def test_the_client_retries_its_own_timeout_with_the_same_key(app_url: str) -> None:
    """gangserve_client's append times out (the answer is held past its timeout_s after the
    commit) and is retried by the client with the same key: the kept answer comes back, the
    session grew once, and the next appends are the reference's rows."""
    from gangserve_client import GangServeClient

    prompt = rand(4, E, seed=301)
    with GangServeClient(app_url, timeout_s=failpoints.LATE_S / 2, retries=3) as client:
        with client.session(prefill=prompt) as s:
            seq = prompt
            arm("session_append_answer_late")
            row = rand(1, E, seed=302)
            started = time.monotonic()
            out = s.append(row, fmt="npy")
            assert time.monotonic() - started >= failpoints.LATE_S / 2  # the first attempt did time out
            assert s.replayed and s.length == 5
            seq = np.concatenate([seq, row])
            assert relative_error(torch.from_numpy(np.array(out)), reference(seq, causal=True)[-1:]) <= TOL
            for i in range(2):
                rows = rand(2, E, seed=303 + i)
                out = s.append(rows)
                seq = np.concatenate([seq, rows])
                assert not s.replayed
                assert relative_error(torch.from_numpy(np.array(out)), reference(seq, causal=True)[-2:]) <= TOL
            assert s.refresh()["length"] == len(seq) == 9


@pytest.mark.ray
def test_concurrent_tries_with_one_key_append_once(app_url: str) -> None:
    """Eight tries of one append (one key, one body) sent at once: whichever arrives first
    appends, the others wait for it while it is in flight or find its answer after; all eight
    answer the same rows, exactly one of them computed, and the session grew once."""
    from concurrent.futures import ThreadPoolExecutor

    s = HttpSession(app_url, None, prefill=rand(3, E, seed=451))
    rows, key = rand(2, E, seed=452), str(uuid.uuid4())
    body = npy_bytes(rows)

    def send(_: int) -> httpx.Response:
        return httpx.post(f"{s.base}/sessions/{s.id}/append", content=body, headers={**NPY, keys.HEADER: key},
                          timeout=60)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(send, range(8)))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    computed = [r for r in replies if keys.REPLAYED_HEADER.lower() not in r.headers]
    assert len(computed) == 1, [dict(r.headers) for r in replies]
    s.check(rows, computed[0])  # the reference's rows at length 5
    for r in replies:
        np.testing.assert_array_equal(output(r), output(computed[0]))
        assert r.headers["x-session-length"] == "5"
    assert s.info()["length"] == 5
    assert s.append(rand(1, E, seed=453), key=str(uuid.uuid4())).status_code == 200  # and still right after


@pytest.mark.ray
def test_a_reused_key_is_409_and_a_bad_key_is_422(app_url: str) -> None:
    s = HttpSession(app_url, None, prefill=rand(2, E, seed=401))
    url, key = f"{app_url}/sessions/{s.id}/append", str(uuid.uuid4())
    first = s.append(rand(1, E, seed=402), key=f'"{key}"')  # the draft's quoted form: the same key
    assert first.status_code == 200, first.text
    doc = assert_error(httpx.post(url, content=npy_bytes(rand(1, E, seed=403)), headers={**NPY, keys.HEADER: key},
                                  timeout=30), 409, "idempotency_key_reused")
    assert key in doc["error"]
    for bad in ("", "has space", "x" * 129, b"caf\xe9"):
        doc = assert_error(httpx.post(url, content=npy_bytes(rand(1, E)), headers={**NPY, keys.HEADER: bad},
                                      timeout=30), 422, "invalid_request")
        assert "Idempotency-Key" in doc["error"]
    assert s.info()["length"] == 3  # nothing above appended
    retry_is_a_replay(s, first, s.seq[-1:], key)


@pytest.mark.ray
def test_an_oip_sequence_request_retried_with_its_key_is_answered_once(app_url: str) -> None:
    seq_id = f"idem-{uuid.uuid4().hex[:8]}"

    def infer(rows: np.ndarray, key: object, start: bool = False) -> httpx.Response:
        body = {"inputs": [{"name": "hidden_states", "shape": list(rows.shape), "datatype": "FP32",
                            "data": rows.ravel().tolist()}],
                "parameters": {"sequence_id": seq_id, "sequence_start": start, "idempotency_key": key}}
        return httpx.post(f"{app_url}/v2/models/attention/infer", json=body, timeout=60)

    def rows_of(r: httpx.Response) -> np.ndarray:
        assert r.status_code == 200, r.text
        return np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(-1, E)

    seq = rand(3, E, seed=501)
    start = infer(seq, "start-1", start=True)
    again = infer(seq, "start-1", start=True)  # a retried start: its answer, not 409 session_exists
    np.testing.assert_array_equal(rows_of(again), rows_of(start))
    row = rand(1, E, seed=502)
    one, two = infer(row, "next-1"), infer(row, "next-1")
    np.testing.assert_array_equal(rows_of(one), rows_of(two))
    assert two.json()["parameters"]["sequence_length"] == 4
    seq = np.concatenate([seq, row])
    assert relative_error(torch.from_numpy(rows_of(one)), reference(seq, causal=True)[-1:]) <= TOL
    assert_error(infer(rand(1, E, seed=503), "next-1"), 409, "idempotency_key_reused")
    assert_error(infer(row, 7), 422, "invalid_request")
    last = rand(1, E, seed=504)
    seq = np.concatenate([seq, last])
    assert relative_error(torch.from_numpy(rows_of(infer(last, "next-2"))), reference(seq, causal=True)[-1:]) <= TOL
