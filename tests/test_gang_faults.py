"""A gang that never hangs: rank death and stuck ranks give bounded errors and a rebuild.

Recovery times are printed (and asserted only loosely); `make bench` is the place for
tight numbers.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from service.parallel.weights import random_weights
from tests.conftest import deploy, local_yaml_args, suite_args, undeploy
from tests.faults import (RequestLoop, driver_side_policy, gang_client_around_kill, gang_info, transport_used,
                          wait_for_new_gang)
from tests.helpers import eventually, pid_alive, poll, rand, scrape, total
from tests.reference import dense_attention, relative_error
from tests.session_client import E, HttpSession

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SEED = 3
WEIGHTS = random_weights(512, SEED)  # the softmax far from one-hot (the notes' seed weights are nearly so)
COLLECTIVE_TIMEOUT_S = 5.0
ALLOWED = {200, 503, 504}


@pytest.fixture(scope="module")
def fault_url(serve_url: str) -> str:
    args = {**local_yaml_args(), "init": "random", "seed": SEED, "cpus_per_rank": 0.25,
            "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
            "warm_spare": True}  # the product's default, which the kill tests are about
    base = deploy(serve_url, "faults", "/faults", args)
    yield base
    undeploy("faults")


def _check_one_request(base: str) -> None:
    x = np.random.default_rng(0).standard_normal((2, 3, 512), dtype=np.float32)
    r = httpx.post(base + "/infer", json={"hidden_states": x.tolist()}, timeout=60)
    assert r.status_code == 200, r.text
    got = torch.tensor(r.json()["output"])
    assert relative_error(got, dense_attention(WEIGHTS, 8, torch.from_numpy(x))) < 1e-5


def _assert_loop_outcomes(loop: RequestLoop, recovered_at: float) -> None:
    summary = loop.summary()
    print("request loop:", summary)
    statuses = set(summary["statuses"])
    assert statuses <= ALLOWED, f"unexpected statuses {summary['statuses']}: {[o.body for o in loop.outcomes if o.status not in ALLOWED][:3]}"
    assert summary["wrong"] == 0, "a 200 carried a wrong answer"
    for o in loop.outcomes:
        if o.status in (503, 504):
            assert o.body and '"error"' in o.body and '"code"' in o.body
    assert any(o.status == 200 and o.at > recovered_at for o in loop.outcomes), "no success after recovery"


def _wait_for_warm_spare(base: str, timeout_s: float = 150) -> dict:
    """/gang once the gang's warm spare answered (it starts after bring-up, in the background, and
    answers once it has loaded the in-place attention the gang's own ranks built: a process's
    start and torch's import, longer on a loaded machine)."""
    def warm() -> dict | None:
        info = gang_info(base) or {}
        return info if info.get("state") == "ready" and info.get("spare", {}).get("state") == "warm" else None

    return eventually(warm, timeout_s, "a ready gang with a warm spare (/gang)")


def test_kill_nonzero_rank_under_load_rebuilds(fault_url: str) -> None:
    """Issue 23: one gang, the default deadline, 8 clients, kill -9 of rank 1: the warm spare
    becomes rank 1 and the gang serves again in about a second (the 1.5 s goal is `make
    bench`'s: bench/run.py --only rebuild); every request is answered 200 with the dense
    reference's rows (the ones the dying gang could not answer are retried inside the service)."""
    info = _wait_for_warm_spare(fault_url)
    victim, spare = info["ranks"][1]["pid"], info["spare"]["pid"]
    retries_before = total(scrape(fault_url), "gangserve_request_retries_total")
    with RequestLoop(fault_url + "/infer", WEIGHTS, threads=8) as loop:
        loop.wait_answered(8)  # the 8 clients are sending: the kill meets requests in flight
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        # Rank 0 lives in the replica and survives an in-process rebuild; rank 1 is new.
        new, recovery_s = wait_for_new_gang(fault_url, {victim}, timeout_s=60)
        recovered_at = time.monotonic()
        loop.wait_answered(8, after=recovered_at)  # and it serves them again
    during = [o.latency_s for o in loop.outcomes if o.at <= recovered_at and o.at + o.latency_s >= killed_at]
    retried = total(scrape(fault_url), "gangserve_request_retries_total") - retries_before
    print(f"kill -9 rank 1 under 8 clients: /gang ready again after {recovery_s:.2f}s, generation "
          f"{new['generation']}; stages {new['last_bring_up']}; rank 1 is the spare: {new['ranks'][1]['pid'] == spare}; "
          f"{loop.summary()}; {len(during)} requests spanned the outage, slowest {max(during, default=0):.2f}s; "
          f"{retried:.0f} retries")
    assert new["ranks"][1]["pid"] == spare and new["last_bring_up"]["spare_adopted_as_rank"] == 1, new
    # The spare compiled the peers' in-place attention before it counted as warm, so the
    # adopting rebuild's compile stage found it compiled: milliseconds, where a fresh process
    # compiles for 2.9-8 s on this machine (~100 bring-ups of one suite).
    assert new["sessions"]["attention"]["path"] == "in_place", new["sessions"]
    assert new["last_bring_up"]["ms"]["compile"] < 1000, new["last_bring_up"]
    # Loose (the suite runs under heavy load): the goal is ~1 s.
    assert recovery_s < 10, f"rebuild with a warm spare took {recovery_s:.1f}s"
    _assert_loop_outcomes(loop, recovered_at)
    assert set(loop.summary()["statuses"]) == {200}, [o.body for o in loop.outcomes if o.status != 200][:3]
    assert retried >= 1, "no request met the broken gang: the kill came too late to test anything"
    assert not pid_alive(victim)
    _check_one_request(fault_url)
    # A new spare is started for the next loss (not waited for: it warms up in the background).
    after = gang_info(fault_url)["spare"]
    assert after["state"] in ("starting", "warm") and after.get("pid") not in (spare, victim), after


def test_kill_rank1_under_session_appends_recomputes_every_session(fault_url: str) -> None:
    """16 sessions appending in a loop while rank 1 is killed with SIGKILL: the gang is
    rebuilt, every append answers 200 and right (the ingress retries the failed step, which
    appended nothing), and the lost K/V is recomputed (counted)."""
    base = fault_url
    sessions = [HttpSession(base, WEIGHTS, prefill=rand(5, E, seed=400 + i)) for i in range(16)]
    info = gang_info(base)
    assert info is not None
    victim, before = info["ranks"][1]["pid"], info["sessions"]["recomputed_tokens"]
    stop = time.monotonic() + 1e9
    counts = [0] * len(sessions)

    def loop(i: int) -> None:
        s = sessions[i]
        while time.monotonic() < stop and counts[i] < 400:
            r = s.append(rand(1, E, seed=i * 1000 + counts[i]))
            assert r.status_code == 200, r.text
            counts[i] += 1

    with ThreadPoolExecutor(len(sessions)) as pool:
        futures = [pool.submit(loop, i) for i in range(len(sessions))]
        eventually(lambda: sum(counts) >= 16, 60, "appends before the kill")
        os.kill(victim, signal.SIGKILL)
        killed_at = sum(counts)
        eventually(lambda: (g := gang_info(base) or {}).get("state") == "ready" and victim not in
                   {r["pid"] for r in g["ranks"]}, 120, "the gang rebuilt")
        eventually(lambda: sum(counts) >= killed_at + 32, 120, "appends after the rebuild")
        stop = time.monotonic()
        for f in futures:
            f.result(timeout=120)
    after = (gang_info(base) or {})["sessions"]["recomputed_tokens"]
    assert after > before, (before, after)
    for s in sessions:  # no session lost, none appended twice
        assert s.info()["length"] == len(s.seq)


def test_stopped_rank_gives_504_at_the_request_deadline_then_rebuild(fault_url: str) -> None:
    """Issue 23: with rank 1 SIGSTOPped, a request with X-Request-Timeout-Seconds: 0.5 gets
    our JSON 504 `deadline_exceeded` at its deadline (not Serve's plain-text 408, not the
    collective timeout's 5 s); requests queued behind the stuck step are dropped at their
    deadline uncomputed (/metrics); an OIP `parameters.timeout` works the same; the gang is
    rebuilt and serves again."""
    info = gang_info(fault_url)
    victim = info["ranks"][1]["pid"]
    x = np.zeros((1, 2, 512), dtype=np.float32)
    before = scrape(fault_url)
    os.kill(victim, signal.SIGSTOP)
    try:
        timings: list[tuple[int, float, str]] = []

        def post(path: str, json: dict, headers: dict | None = None) -> None:
            t0 = time.monotonic()
            r = httpx.post(fault_url + path, json=json, headers=headers or {}, timeout=120)
            timings.append((r.status_code, time.monotonic() - t0, r.text))

        header = {"X-Request-Timeout-Seconds": "0.5"}
        oip = {"inputs": [{"name": "hidden_states", "shape": [1, 2, 512], "datatype": "FP32",
                           "data": x.ravel().tolist()}], "parameters": {"timeout": 500_000}}
        # The first takes the gang's step (stuck); the later ones queue behind it in the gang.
        clients = [threading.Thread(target=post, args=("/infer", {"hidden_states": x.tolist()}, header))
                   for _ in range(3)]
        clients.append(threading.Thread(target=post, args=("/v2/models/attention/infer", oip)))
        for c in clients:
            c.start()
            time.sleep(0.15)  # pacing: the first takes the stuck step, the others queue in order behind it
        for c in clients:
            c.join(timeout=60)
        print("SIGSTOP rank 1, deadline 0.5 s:", [(s, round(t, 3), text[:100]) for s, t, text in timings])
        assert len(timings) == 4
        for status, elapsed, text in timings:
            assert status == 504, text
            assert text.startswith("{") and '"code":"deadline_exceeded"' in text.replace(" ", ""), text
            # 0.5 + 0.2 s is the goal (README failure table); loose here: the machine is shared.
            assert elapsed < 0.5 + 1.5, f"answered after {elapsed:.2f}s for a 0.5 s deadline"
        new, recovery_s = wait_for_new_gang(fault_url, {victim}, timeout_s=60)
        print(f"SIGSTOP rank 1: recovered {recovery_s:.1f}s after the requests")
    finally:
        if pid_alive(victim):
            os.kill(victim, signal.SIGCONT)
    def dropped(samples: dict) -> float:
        return total(samples, "gangserve_requests_dropped_total", reason="deadline") - \
            total(before, "gangserve_requests_dropped_total", reason="deadline")

    # The gang server's counters arrive with its next report to the controller (<= 1 s).
    n_dropped = dropped(poll(fault_url, lambda s: dropped(s) >= 1, 10, "a request dropped at its deadline"))
    print(f"dropped uncomputed at their deadline: {n_dropped:.0f}")
    _check_one_request(fault_url)


def test_rank_death_during_channel_requests_is_a_clean_error_then_channel_again(fault_url: str) -> None:
    """kill -9 of rank 1 while data-channel requests flow (a real request policy, the ingress's
    code, in this process): every request gets its exact rows (the ones the dying gang could
    not answer are retried once it is rebuilt, issue 23), and the rebuilt gang is served over
    the channel again."""
    args = {"cpus_per_rank": 0.25, "collective_timeout_s": COLLECTIVE_TIMEOUT_S}
    policy = driver_side_policy(fault_url, "faults", **args)
    victim = httpx.get(fault_url + "/gang", timeout=30).json()["ranks"][1]["pid"]
    x = np.random.default_rng(25).standard_normal((1, 8, 512), dtype=np.float32)
    want = dense_attention(WEIGHTS, 8, torch.from_numpy(x))
    outcomes = gang_client_around_kill(policy, x, want, victim)
    print("channel requests around kill -9 of rank 1:", {c: outcomes.count(c) for c in set(outcomes)})
    assert set(outcomes) == {"ok"}, outcomes
    assert policy.retries >= 1, "no request met the broken gang: the kill came too late"  # type: ignore[attr-defined]
    wait_for_new_gang(fault_url, {victim}, timeout_s=60)
    fresh = driver_side_policy(fault_url, "faults", **args)
    out = np.array(asyncio.run(fresh.infer(x)))  # type: ignore[attr-defined]
    assert relative_error(torch.from_numpy(out), want) < 1e-5
    used = transport_used(fresh)
    assert used["data_channel"] == 1 and used["data_channel_fallbacks"] == 0, used


def test_kill_rank0_replica_under_load_recovers(fault_url: str) -> None:
    info = _wait_for_warm_spare(fault_url)
    old_pids = {r["pid"] for r in info["ranks"]} | {info["spare"]["pid"]}  # the spare dies with it too
    rank0 = info["ranks"][0]["pid"]
    with RequestLoop(fault_url + "/infer", WEIGHTS) as loop:
        loop.wait_answered(2)  # both clients are sending
        os.kill(rank0, signal.SIGKILL)
        new, recovery_s = wait_for_new_gang(fault_url, old_pids, timeout_s=120)
        recovered_at = time.monotonic()
        loop.wait_answered(2, after=recovered_at)
    print(f"kill -9 rank 0 (replica): recovered in {recovery_s:.1f}s")
    _assert_loop_outcomes(loop, recovered_at)
    # Issue 23: the requests the dead replica held, and those that came meanwhile, wait for
    # Serve's new replica (within their deadline) and are answered.
    assert set(loop.summary()["statuses"]) == {200}, [o.body for o in loop.outcomes if o.status != 200][:3]
    # The old peers die with their owner (the dead replica): no orphans.
    eventually(lambda: not any(pid_alive(p) for p in old_pids), 30,
               f"the old rank processes {sorted(old_pids)} gone after rank 0 died (no orphans)")
    _check_one_request(fault_url)


def test_readiness_turns_off_within_2s_of_losing_the_only_gang_and_on_once_a_new_one_serves(fault_url: str) -> None:
    """kill -9 of the only gang's rank 0 (its GangServer replica): /readyz and
    /v2/health/ready answer 503 with the reason within 2 s, /gangs never lists the dead
    replica as ready, and readiness comes back only when the replacement really serves."""
    info = gang_info(fault_url)
    assert httpx.get(fault_url + "/readyz", timeout=10).status_code == 200
    dead, rank0 = info["replica_id"], info["ranks"][0]["pid"]
    os.kill(rank0, signal.SIGKILL)
    killed_at = time.monotonic()
    off = None
    while off is None and time.monotonic() - killed_at < 10:
        r = httpx.get(fault_url + "/readyz", timeout=10)
        if r.status_code == 503:
            off = time.monotonic() - killed_at, r.json()
        time.sleep(0.05)
    assert off is not None, "/readyz still 200 10 s after the only gang's rank 0 was killed"
    off_after, body = off
    print(f"/readyz 503 {off_after:.2f}s after the kill: {body}")
    assert off_after <= 2.0, f"/readyz took {off_after:.2f}s to notice the loss (goal: 2 s)"
    assert body["code"] and dead in body["error"], body
    oip = httpx.get(fault_url + "/v2/health/ready", timeout=10)
    assert oip.status_code == 503 and oip.json()["code"] == body["code"], oip.text
    # Until the replacement serves: 503, and the dead replica never listed as ready.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        gangs = httpx.get(fault_url + "/gangs", timeout=10).json()
        assert dead not in {g["replica_id"] for g in gangs["gangs"] if g["state"] == "ready"}, gangs
        r = httpx.get(fault_url + "/readyz", timeout=10)
        if r.status_code == 200:
            break
        assert r.json()["code"], r.text
        time.sleep(0.25)
    else:
        raise AssertionError(f"no replacement gang within 120 s; last /readyz: {r.text}")
    print(f"/readyz 200 again {time.monotonic() - killed_at:.1f}s after the kill")
    _check_one_request(fault_url)  # ready means it serves: the very next request succeeds
    assert httpx.get(fault_url + "/v2/health/ready", timeout=10).status_code == 200


def _controller_pid(app: str) -> int:
    import ray

    alive = [a for a in ray._private.state.state.actor_table(None).values()
             if a["State"] == "ALIVE" and a["ActorClassName"] == f"ServeReplica:{app}:Controller"]
    assert len(alive) == 1, [a["ActorClassName"] for a in alive]
    return int(alive[0]["Pid"])


def test_losing_the_controller_changes_nothing_a_client_sees(fault_url: str) -> None:
    """kill -9 of the app's Controller (fleet view, weights record): readiness falls back to
    asking the gang and stays 200, requests keep being served, and once Serve has replaced it
    the gangs report to the new one within seconds."""
    victim = _controller_pid("faults")
    with RequestLoop(fault_url + "/infer", WEIGHTS) as loop:
        loop.wait_answered(2)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        answers = []
        # By design: /readyz must stay 200 through the whole window without the controller.
        while time.monotonic() - killed_at < 8:
            answers.append(httpx.get(fault_url + "/readyz", timeout=10).status_code)
            time.sleep(0.1)

        def reported() -> httpx.Response | None:
            gangs = httpx.get(fault_url + "/gangs", timeout=10)
            return gangs if gangs.status_code == 200 and gangs.json()["ready"] == 1 else None

        gangs = eventually(reported, 60, "/gangs with the gang reported to the new controller (ready == 1)")
        back_s = time.monotonic() - killed_at
    summary = loop.summary()
    print(f"controller killed: /readyz answers {sorted(set(answers))} ({len(answers)} polls), "
          f"/gangs back after {back_s:.1f}s, load {summary}")
    assert set(answers) == {200}, answers
    assert gangs.status_code == 200 and gangs.json()["ready"] == 1, gangs.text
    assert summary["wrong"] == 0 and set(summary["statuses"]) == {200}, summary
    assert _controller_pid("faults") != victim


def test_redeploy_under_load_drains_and_loses_no_request(fault_url: str) -> None:
    """Issue 23 item 5: a redeploy (a changed builder arg: Serve replaces the ingress and the
    gang server) under load from 4 clients: every accepted request is answered 200 with the
    dense reference's rows: the old replicas finish what they hold (Serve's handle drain,
    then the gang server's data channel and queue) before their gang goes."""
    from ray import serve

    from service.app import build_app

    before = {r["pid"] for r in gang_info(fault_url)["ranks"]}
    args = {**local_yaml_args(), "init": "random", "seed": SEED, "cpus_per_rank": 0.25,
            "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
            "max_queued_requests": 255}  # any change: a new version of both deployments
    def redeployed() -> bool:
        info = gang_info(fault_url)
        return bool(info and info.get("state") == "ready" and not ({r["pid"] for r in info["ranks"]} & before)
                    and str(serve.status().applications["faults"].status).endswith("RUNNING"))

    with RequestLoop(fault_url + "/infer", WEIGHTS, threads=4) as loop:
        loop.wait_answered(4)
        t0 = time.monotonic()
        serve.run(build_app(suite_args(args)), name="faults", route_prefix="/faults", blocking=False)
        eventually(redeployed, 150, "the app RUNNING again with a new gang serving (no old rank pid)", 0.5)
        redeployed_s = time.monotonic() - t0
        loop.wait_answered(4, after=time.monotonic())  # the new gang answers the load
    summary = loop.summary()
    print(f"redeploy under 4 clients: {summary}; new gang serving and the app RUNNING after {redeployed_s:.1f}s")
    assert summary["wrong"] == 0 and set(summary["statuses"]) == {200}, \
        (summary, [o.body for o in loop.outcomes if o.status != 200][:3])
    _check_one_request(fault_url)


def test_failed_rebuild_is_retried_with_backoff_and_reported(serve_url: str, tmp_path) -> None:
    """A rebuild that cannot reload the weights (checkpoint gone) is reported in /readyz and
    retried with backoff; once the file is back the gang recovers on its own."""
    import shutil

    from service.parallel.weights import random_weights, save_checkpoint

    weights = random_weights(512, seed=12)
    path = tmp_path / "w.safetensors"
    save_checkpoint(path, weights, num_heads=8)
    args = {**local_yaml_args(), "init": "random", "seed": SEED, "cpus_per_rank": 0.25,
            "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
            "checkpoint": str(path)}
    base = deploy(serve_url, "rebuild", "/rebuild", args)
    try:
        victim = gang_info(base)["ranks"][1]["pid"]
        shutil.move(path, tmp_path / "away.safetensors")
        os.kill(victim, signal.SIGKILL)
        def reported() -> dict | None:
            r = httpx.get(base + "/readyz", timeout=10)
            return r.json() if r.status_code == 503 and "rebuild attempt" in r.json()["error"] else None

        seen = eventually(reported, 60, "/readyz 503 reporting the failed rebuild attempt")
        print("failed rebuild reported:", seen)
        # The reason names the missing file (its path only to callers holding the API token).
        assert "retrying in" in seen["error"] and "No such file or directory" in seen["error"]
        shutil.move(tmp_path / "away.safetensors", path)
        new, recovery_s = wait_for_new_gang(base, {victim}, timeout_s=90)
        print(f"recovered {recovery_s:.1f}s after the checkpoint came back (failed_rebuilds reset: {new['failed_rebuilds']})")
        assert new["failed_rebuilds"] == 0
        x = np.random.default_rng(3).standard_normal((1, 4, 512), dtype=np.float32)
        r = httpx.post(base + "/infer", json={"hidden_states": x.tolist()}, timeout=60)
        assert r.status_code == 200
        assert relative_error(torch.tensor(r.json()["output"]), dense_attention(weights, 8, torch.from_numpy(x))) < 1e-5
    finally:
        undeploy("rebuild")
