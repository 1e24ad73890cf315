"""The ingress's request policy, part by part (service.ingress.requests and its parts): the
retry table and the retrier, the status view, the outage estimate, admission and the weights
admin. Each part is the real class; what it calls across the process boundary (a GangServer
replica's handle) is a small in-process object answering as the replica does, and the link
and the fleet client are the real ones (no channel, no Controller)."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from service.config.builder_args import AppConfig
from service.config.tunables import TransportTunables
from service.contract.errors import (RETRYABLE_CODES, BadRequest, DeadlineExceeded, ErrorCode, GangServeError,
                                     GangUnavailable)
from service.contract.gang_status import (AbsentState, GangRow, GangState, GangStatus, IngressGangStatus,
                                          ObservedState, SynthesizedStatus)
from service.ingress.admission import Admission
from service.ingress.fleet_client import FleetClient
from service.ingress.outages import OutageEstimate
from service.ingress.requests import RequestPolicy
from service.ingress.retries import REFUSED_BEFORE_RUNNING, RETRY_TABLE, GangMethod, Retrier, RetryRule
from service.ingress.status_view import GangStatusView, unavailable_error
from service.transport.link import GangLink
from tests.statuses import gang_report

pytestmark = pytest.mark.unit

CONFIG = AppConfig()


class _Replica:
    """A GangServer replica's handle methods, in process (GangServerCalls' `call`): answers
    `describe` with `status`, each other method with `answers[method]` in turn (an exception
    is raised), and records every call's method and idempotency key."""

    def __init__(self, status: GangStatus, answers: dict[str, list[Any]] | None = None) -> None:
        self.status = status
        self.answers = answers or {}
        self.calls: list[tuple[str, str | None]] = []
        self.replica_lost_at = 0.0

    async def call(self, method: str, *args: Any, timeout_s: float | None = None, deadline: float | None = None,
                   **kwargs: Any) -> Any:
        self.calls.append((method, kwargs.get("idempotency_key")))
        if method == "describe":
            return self.status
        answer = self.answers[method].pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def sent(self, method: str) -> list[str | None]:
        return [key for m, key in self.calls if m == method]


def _link(replica: _Replica) -> GangLink:
    return GangLink(node_id="node0", channel_enabled=False, shm_enabled=False, calls=replica,
                    tunables=TransportTunables())


def _policy(replica: _Replica, **serving: Any) -> RequestPolicy:
    config = AppConfig.model_validate({**serving}) if serving else CONFIG
    return RequestPolicy(replica, _link(replica), FleetClient(None, config), config)  # type: ignore[arg-type]


def _broken() -> GangUnavailable:
    return GangUnavailable("gang is broken: rank 1 died", code=ErrorCode.GANG_BROKEN)


def _rebuilding() -> GangUnavailable:
    return GangUnavailable("gang is rebuilding", code=ErrorCode.GANG_REBUILDING)


# -- the retry table and the retrier ------------------------------------------------------
def test_every_call_declares_its_retries_and_a_call_that_is_not_idempotent_retries_only_safely() -> None:
    assert set(RETRY_TABLE) == set(GangMethod)
    for method, rule in RETRY_TABLE.items():
        assert rule.retry_codes <= RETRYABLE_CODES, method
        if not (rule.idempotent or rule.needs_key):  # a second run would do it twice
            assert rule.retry_codes <= REFUSED_BEFORE_RUNNING, method
    assert ErrorCode.GANG_BROKEN not in REFUSED_BEFORE_RUNNING  # a rank may die after the step took effect
    with pytest.raises(ValueError, match="gang_broken"):
        RetryRule(idempotent=False, needs_key=False, retry_codes=frozenset({ErrorCode.GANG_BROKEN}))


def _run(retrier: Retrier, method: GangMethod, failures: list[GangServeError], *, has_key: bool = False,
         deadline_s: float = 5.0) -> tuple[Any, list[int], list[str]]:
    """retrier.run over a try that raises `failures` in turn, then answers 'done'."""
    attempts: list[int] = []
    seen: list[str] = []

    async def try_once(attempt: int) -> str:
        attempts.append(attempt)
        if failures:
            raise failures.pop(0)
        return "done"

    out = asyncio.run(retrier.run(method, try_once, time.monotonic() + deadline_s, has_key=has_key,
                                  before_retry=lambda exc: seen.append(exc.code)))
    return out, attempts, seen


def test_an_idempotent_call_is_tried_again_after_each_retryable_code_until_it_answers() -> None:
    retrier = Retrier((0.0,))
    out, attempts, seen = _run(retrier, GangMethod.INFER, [_broken(), _rebuilding()])
    assert (out, attempts, seen, retrier.retries) == ("done", [0, 1, 2], ["gang_broken", "gang_rebuilding"], 2)


def test_a_refusal_of_the_request_itself_is_never_tried_again() -> None:
    retrier = Retrier((0.0,))
    with pytest.raises(BadRequest):
        _run(retrier, GangMethod.INFER, [BadRequest("x must be float32; got int64")])
    assert retrier.retries == 0


def test_an_open_is_tried_again_only_after_a_code_that_says_nothing_ran() -> None:
    retrier = Retrier((0.0,))
    out, attempts, _ = _run(retrier, GangMethod.SESSION_OPEN, [_rebuilding()])
    assert (out, attempts) == ("done", [0, 1])
    with pytest.raises(GangUnavailable) as raised:  # the open may have run: a retry could open a second session
        _run(retrier, GangMethod.SESSION_OPEN, [_broken()])
    assert raised.value.code == ErrorCode.GANG_BROKEN and retrier.retries == 1


def test_an_append_is_tried_again_only_with_an_idempotency_key() -> None:
    retrier = Retrier((0.0,))
    with pytest.raises(ValueError, match="idempotency key"):
        _run(retrier, GangMethod.SESSION_APPEND, [_broken()], has_key=False)
    out, attempts, _ = _run(retrier, GangMethod.SESSION_APPEND, [_broken()], has_key=True)
    assert (out, attempts) == ("done", [0, 1])


def test_the_backoff_ends_at_the_deadline() -> None:
    retrier = Retrier((10.0,))
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="retrying after gang_broken"):
        _run(retrier, GangMethod.INFER, [_broken()], deadline_s=0.2)
    assert time.monotonic() - started < 5.0


# -- the policy: one key over every try ---------------------------------------------------
def test_the_policy_makes_one_key_before_the_first_try_and_sends_it_on_every_try() -> None:
    out = (np.zeros((1, 4), np.float32), {"length": 1})
    replica = _Replica(gang_report(), {"session_append": [_broken(), out], "session_open": [_broken()]})
    policy = _policy(replica)

    async def scenario() -> Any:
        answer = await policy.session_call(GangMethod.SESSION_APPEND, np.zeros((1, 4), np.float32), None,
                                           session_id="r1-abc", deadline=time.monotonic() + 10)
        with pytest.raises(GangUnavailable):
            await policy.session_call(GangMethod.SESSION_OPEN, None, session_id=None, deadline=time.monotonic() + 10)
        return answer

    assert asyncio.run(scenario()) is out
    keys = replica.sent("session_append")
    assert len(keys) == 2 and keys[0] is not None and keys[0] == keys[1], keys
    assert replica.sent("session_open") == [None] and policy.retries == 1


class _Rebuilding(_Replica):
    """A one-gang replica whose gang broke: `describe` says rebuilding `describes` times, then
    ready again; a session append is refused with gang_rebuilding until then."""

    def __init__(self, describes: int, out: Any) -> None:
        super().__init__(gang_report("rebuilding", "rebuilding after: rank 1 died"))
        self.describes, self.out = describes, out

    async def call(self, method: str, *args: Any, timeout_s: float | None = None, deadline: float | None = None,
                   **kwargs: Any) -> Any:
        self.calls.append((method, kwargs.get("idempotency_key")))
        if method == "describe":
            self.describes -= 1
            if self.describes < 0:
                self.status = gang_report()
            return self.status
        if self.status.state is not GangState.READY:
            raise _rebuilding()
        return self.out


def test_with_one_gang_a_session_call_waits_for_the_rebuild_instead_of_sending_it_again_and_again() -> None:
    """The retry table's premise for one gang: a call is sent again once the gang is ready
    again. An append refused by a rebuilding gang waits, reading the gang's status every
    `wait_poll_s`, and is sent once more when the status says ready (it used to be re-sent at
    every backoff step, each answered 503 again)."""
    out = (np.zeros((1, 4), np.float32), {"length": 1})
    replica = _Rebuilding(describes=6, out=out)
    policy = _policy(replica)

    async def scenario() -> Any:
        return await policy.session_call(GangMethod.SESSION_APPEND, np.zeros((1, 4), np.float32), None,
                                         session_id="r1-abc", deadline=time.monotonic() + 10)

    assert asyncio.run(scenario()) is out
    appends = replica.sent("session_append")
    assert replica.describes < 0 and len(appends) <= 2, replica.calls  # the first try, then one once ready
    assert len(set(appends)) == 1  # one key on every try


# -- the status view ------------------------------------------------------------------------
def _view(replica: _Replica) -> tuple[GangStatusView, GangLink]:
    link = _link(replica)

    async def describe() -> GangStatus:
        return await replica.call("describe")

    return GangStatusView(describe, FleetClient(None, CONFIG), link, lambda: replica.replica_lost_at,
                          single_gang=True, describe_timeout_s=1.0), link


def test_the_status_view_reads_again_only_when_stale_or_told_to() -> None:
    replica = _Replica(gang_report(state="rebuilding", reason="rank 1 died"))
    view, _ = _view(replica)

    async def scenario() -> list[GangState]:
        states = [(await view.read(max_age_s=60.0)).state]
        replica.status = gang_report()
        states.append((await view.read(max_age_s=60.0)).state)  # fresh enough: not asked again
        view.look_again()  # e.g. a request failed
        states.append((await view.read(max_age_s=60.0)).state)
        replica.replica_lost_at = time.monotonic() + 1  # a call failed on the way: later than the last read
        replica.status = gang_report(state="broken", reason="x")
        states.append((await view.read(max_age_s=60.0)).state)
        return states

    states = asyncio.run(scenario())
    assert states == [GangState.REBUILDING, GangState.REBUILDING, GangState.READY, GangState.BROKEN]
    assert len(replica.sent("describe")) == 3 and not view.seen_ready


def test_a_status_read_never_outlasts_the_requests_deadline() -> None:
    replica = _Replica(gang_report())

    async def hang() -> GangStatus:  # the gang server does not answer
        await asyncio.sleep(30)
        raise AssertionError("never answers")

    view = GangStatusView(hang, FleetClient(None, CONFIG), _link(replica), lambda: 0.0, single_gang=True,
                          describe_timeout_s=1.0)
    started = time.monotonic()
    assert asyncio.run(view.read_by(time.monotonic() + 0.1, max_age_s=1.0)) is None
    assert time.monotonic() - started < 5.0


def test_each_status_answers_the_code_of_its_state() -> None:
    report = gang_report(state="broken", reason="rank 1 died")
    assert unavailable_error(report).code == ErrorCode.GANG_BROKEN
    row = GangRow.of(gang_report(), reported_s_ago=9.0, unreachable_because="no report for 9.0s",
                     code=ErrorCode.GANG_UNREACHABLE)
    assert (row.state, unavailable_error(row).code) == (ObservedState.UNREACHABLE, ErrorCode.GANG_UNREACHABLE)
    timed_out = SynthesizedStatus(state="unschedulable", code=ErrorCode.SCHEDULE_TIMEOUT, reason="60 s passed")
    error = unavailable_error(timed_out, reason="<redacted>")
    assert (error.code, error.message) == (ErrorCode.SCHEDULE_TIMEOUT, "<redacted>")
    assert "gang is scheduling: waiting" in unavailable_error(
        SynthesizedStatus(state="scheduling", code=ErrorCode.GANG_SCHEDULING, reason="waiting")).message


def test_describe_composes_the_gangs_own_report_with_this_ingress_transport() -> None:
    replica = _Replica(gang_report())
    shown = asyncio.run(_policy(replica).describe())
    assert isinstance(shown, IngressGangStatus) and shown.replica_id == "r1"
    assert (shown.ingress_transport.node_id, shown.ingress_transport.shm_enabled) == ("node0", False)


# -- the outage estimate --------------------------------------------------------------------
def test_a_request_the_gang_is_not_expected_back_for_gets_503_with_the_expected_wait() -> None:
    outages = OutageEstimate(default_outage_s=5.0)
    outages.saw_failure()
    with pytest.raises(GangUnavailable) as refused:
        outages.check("gang is rebuilding", deadline=time.monotonic() + 1.0)
    assert refused.value.code == ErrorCode.DEADLINE_UNMEETABLE and refused.value.retry_after_s == 5.0
    assert "the last outage lasted 5.0s" in refused.value.message
    outages.check("gang is rebuilding", deadline=time.monotonic() + 6.0)  # it is expected back first
    time.sleep(0.05)
    outages.served()  # the outage lasted ~0.05 s: the next estimate
    outages.saw_failure()
    assert outages.expected_wait_s() < 1.0
    outages.check("gang is rebuilding", deadline=time.monotonic() + 1.0)


# -- admission ------------------------------------------------------------------------------
def test_with_one_gang_any_state_but_ready_waits_with_several_only_the_app_wide_ones() -> None:
    broken, scheduling = gang_report(state="broken", reason="x"), SynthesizedStatus(
        state="scheduling", code="gang_scheduling", reason="waiting for 2 CPUs")
    one = Admission(OutageEstimate(5.0), single_gang=True, max_queued_requests=8, poll_s=0.01)
    several = Admission(OutageEstimate(5.0), single_gang=False, max_queued_requests=8, poll_s=0.01)
    assert [one.must_wait(s) for s in (gang_report(), broken, scheduling)] == [False, True, True]
    assert [several.must_wait(s) for s in (gang_report(), broken, scheduling)] == [False, False, True]


def test_waiting_requests_are_bounded_and_an_unschedulable_gang_is_never_waited_for() -> None:
    status = gang_report(state="rebuilding", reason="rank 1 died")
    admission = Admission(OutageEstimate(0.5), single_gang=True, max_queued_requests=1, poll_s=0.3)

    async def scenario() -> GangServeError:
        first = asyncio.create_task(admission.wait(status, time.monotonic() + 5))
        await asyncio.sleep(0.05)
        assert admission.waiting == 1
        with pytest.raises(GangUnavailable) as refused:
            await admission.wait(status, time.monotonic() + 5)
        await first
        assert admission.waiting == 0
        return refused.value

    refused = asyncio.run(scenario())
    assert refused.code == ErrorCode.OVERLOADED and "max_queued_requests=1" in refused.message
    never = SynthesizedStatus(state=AbsentState.UNSCHEDULABLE, code="unschedulable", reason="needs 64 GPUs")
    with pytest.raises(GangServeError) as unplaceable:
        asyncio.run(admission.wait(never, time.monotonic() + 5))
    assert unplaceable.value.code == "unschedulable"


# -- weights admin --------------------------------------------------------------------------
def test_a_swap_is_its_own_call_and_the_status_is_read_fresh_after_it() -> None:
    swapped = gang_report(weights_version=4)
    replica = _Replica(gang_report(weights_version=3), {"reload_weights": [swapped]})
    policy = _policy(replica)

    async def scenario() -> list[int]:
        versions = [(await policy.status.read(max_age_s=60.0)).weights_version]  # type: ignore[union-attr]
        replica.status = swapped
        assert await policy.weights.reload_weights("checkpoints/x.safetensors") is swapped
        versions.append((await policy.status.read(max_age_s=60.0)).weights_version)  # type: ignore[union-attr]
        return versions

    assert asyncio.run(scenario()) == [3, 4]
    assert [m for m, _ in replica.calls] == ["describe", "reload_weights", "describe"]
