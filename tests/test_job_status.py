"""The job-status contract (service.training.status): the transition table, every allowed
and every refused move; the job store obeying it in its one atomic UPDATE (SQLite and
PostgreSQL); and the /train response models (service.training.public) keeping every key of
a job's public JSON. The contract's rules are written out here (`legal`), not read from the code."""
from __future__ import annotations

import itertools
from typing import Any

import pytest

from service.training.status import (
    ACTIVE,
    TERMINAL,
    IllegalTransition,
    JobStatus,
    can_move,
    check_transition,
    sources,
)

pytestmark = pytest.mark.unit

P, R, S, F, C = "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"
STATUSES = (P, R, S, F, C)
ALL_PAIRS = list(itertools.product(STATUSES, repeat=2))


def legal(frm: str, to: str) -> bool:
    """The contract (docs/training.md), as its three rules: an ended job never changes; a
    running job never goes back to PENDING; anything else an active job may become (itself
    included: a write of other fields). The store test below runs every pair against it."""
    return frm in (P, R) and not (frm == R and to == P)


def test_the_status_set_is_the_contracts() -> None:
    assert [s.value for s in JobStatus] == list(STATUSES)
    assert ACTIVE == (P, R) and TERMINAL == (S, F, C)
    assert all(JobStatus(s).active != JobStatus(s).terminal for s in STATUSES)
    # A str: compares, formats and JSON-encodes as its name (what the store and clients see).
    assert JobStatus.RUNNING == "RUNNING" and f"{JobStatus.FAILED}" == "FAILED"


@pytest.mark.parametrize("ended", [S, F, C])
def test_an_ended_job_never_changes(ended: str) -> None:
    for to in STATUSES:
        assert not can_move(ended, to), (ended, to)
        with pytest.raises(IllegalTransition) as info:
            check_transition(ended, to, "job-42")
        err = info.value
        assert err.status == 409 and err.code == "illegal_transition" and (err.frm, err.to) == (ended, to)
        assert f"job job-42 cannot move from {ended} to {to} (allowed from {ended}: none: it is terminal)" \
            == err.message


def test_a_running_job_never_goes_back_to_pending() -> None:
    assert not can_move(R, P)
    with pytest.raises(IllegalTransition, match=r"cannot move from RUNNING to PENDING \(allowed from RUNNING: "
                                                r"CANCELLED, FAILED, RUNNING, SUCCEEDED\)"):
        check_transition(JobStatus.RUNNING, JobStatus.PENDING)


@pytest.mark.parametrize("active", [P, R])
def test_an_active_job_may_end_every_way_and_take_progress_updates(active: str) -> None:
    for to in (active, *TERMINAL):
        assert can_move(active, to) and can_move(JobStatus(active), JobStatus(to)), (active, to)
        assert check_transition(active, to) is JobStatus(to)
    # A job that was never seen running may still end (cancelled, never scheduled, finished unseen).
    assert check_transition(P, R) is JobStatus.RUNNING


def test_sources_are_exactly_the_statuses_that_may_move_there() -> None:
    assert sources(P) == (P,) and sources(R) == (P, R)
    for to in TERMINAL:
        assert sources(to) == (P, R), to
    for frm, to in ALL_PAIRS:
        assert (frm in sources(to)) is can_move(frm, to), (frm, to)


def test_an_unknown_status_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match=r"unknown job status 'DONE'; valid: PENDING, RUNNING, SUCCEEDED"):
        can_move("RUNNING", "DONE")
    with pytest.raises(ValueError, match="unknown job status 'running'"):
        check_transition("running", "FAILED")


def _record(job_id: str, status: str, **kw: Any) -> Any:
    from service.training.store import JobRecord

    return JobRecord(id=job_id, status=status, spec={"world_size": 1}, created_at=1.0, updated_at=1.0,
                     progress={"epoch": 0, "epochs": 2, "step": 0, "loss": None}, **kw)


def test_the_store_refuses_every_illegal_move_in_its_one_update(store_url: str) -> None:
    """On SQLite and PostgreSQL: one job per (from, to) pair; a refused move changes nothing
    (not even the other fields of that update), an allowed one writes them all."""
    from service.training.store import JobStore

    store = JobStore(store_url)
    try:
        for i, (frm, _) in enumerate(ALL_PAIRS):
            store.create_job(_record(f"job-{i}", frm))
        for i, (frm, to) in enumerate(ALL_PAIRS):
            allowed = legal(frm, to)
            assert store.update_job(f"job-{i}", status=to, reason="moved") is allowed, (frm, to)
            after = store.get_job(f"job-{i}")
            assert isinstance(after.status, JobStatus)
            assert (after.status, after.reason) == ((to, "moved") if allowed else (frm, None)), (frm, to)
        # Without a status: only active jobs take other fields (a late progress update after a cancel).
        store.create_job(_record("job-done", C))
        store.create_job(_record("job-live", R))
        assert not store.update_job("job-done", progress={"epoch": 1})
        assert store.update_job("job-live", progress={"epoch": 1})
        assert store.get_job("job-done").progress["epoch"] == 0 and store.get_job("job-live").progress["epoch"] == 1
        with pytest.raises(ValueError, match="unknown job status 'DONE'"):
            store.update_job("job-live", status="DONE")
        # The counts and the public JSON carry plain names.
        counts = store.status_counts()
        assert sum(counts.values()) == len(ALL_PAIRS) + 2 and set(counts) <= set(STATUSES)
        public = store.get_job("job-live").to_public()
        assert type(public["status"]) is str and public["status"] == R
    finally:
        store.close()


# ---- the response models of /train -------------------------------------------------------------

def _public_job() -> dict[str, Any]:
    """A SUCCEEDED record's public dict, every optional part filled."""
    rec = _record(
        "job-0123abcd", S, started_at=2.0, finished_at=9.5, reason=None, error=None, attempts=2, resumes=1,
        resumed_from_epoch=1, init_from={"job_id": "job-feed"},
        checkpoint={"path": "checkpoints/job-0123abcd.safetensors", "url": "/train/job-0123abcd/checkpoint",
                    "format": "linear", "bytes": 1234},
        workers=[{"rank": 0, "pid": 7, "node_id": "n" * 56, "node_ip": "127.0.0.1", "iface": "lo", "attempt": 2}],
        history=[{"epoch": 1, "loss": 2.0, "eval_loss": None, "at": 3.0},
                 {"epoch": 2, "loss": 1.5, "eval_loss": 1.25, "at": 5.0}],
    )
    return rec.to_public()


def test_every_public_key_is_documented_and_survives_the_model() -> None:
    from service.training.public import JobList, JobView

    job = _public_job()
    assert set(job) == set(JobView.model_fields), "to_public and JobView disagree: document the new key"
    assert all(f.description for f in JobView.model_fields.values())
    assert JobView.model_validate(job).model_dump(mode="json") == job
    page = {"jobs": [job, {**job, "id": "job-2", "status": R, "checkpoint": None, "final_eval_loss": None}],
            "next": "17"}
    assert JobList.model_validate(page).model_dump(mode="json") == page
    # A key added to to_public before it is documented still reaches clients.
    assert JobView.model_validate({**job, "new_key": [1]}).model_dump(mode="json")["new_key"] == [1]
    with pytest.raises(ValueError, match="status"):
        JobView.model_validate({**job, "status": "DONE"})


class _Manager:
    """Stands in for the JobManager behind `JobsClient.call` (the routes are under test)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job

    async def call(self, method: str, *args: Any) -> Any:
        return {"list_jobs": {"jobs": [self.job], "next": None}}.get(method, self.job)


def test_the_train_routes_answer_the_dicts_unchanged_through_their_response_models() -> None:
    """FastAPI validates and re-serializes a route's answer through its response_model: the
    JSON must still equal the JobManager's dict (the status page and the CLI read it), and
    OpenAPI documents the models."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from service.ingress.auth import require_token
    from service.ingress.jobs_client import get_jobs
    from service.ingress.routes.train import router

    job = {**_public_job(), "new_key": "kept"}
    app = FastAPI()
    app.include_router(router)
    app.dependency_overrides[get_jobs] = lambda: _Manager(job)
    app.dependency_overrides[require_token] = lambda: None  # auth has its own tests
    with TestClient(app) as client:
        assert client.get(f"/train/{job['id']}").json() == job
        assert client.post(f"/train/{job['id']}/cancel").json() == job
        assert client.get("/train").json() == {"jobs": [job], "next": None}
        doc = client.get("/openapi.json").json()
    ok = doc["paths"]["/train/{job_id}"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/JobView"}
    view = doc["components"]["schemas"]["JobView"]
    assert view["properties"]["status"]["$ref"] == "#/components/schemas/JobStatus"
    assert doc["components"]["schemas"]["JobStatus"]["enum"] == [P, R, S, F, C]
    submitted = doc["paths"]["/train"]["post"]["responses"]["202"]["content"]["application/json"]["schema"]
    assert submitted == {"$ref": "#/components/schemas/JobView"}
