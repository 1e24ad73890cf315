"""The state database through the real service: a JobManager deployment on PostgreSQL
(GANGSERVE_DATABASE_URL through its runtime_env) on the session's Ray cluster, called
through the ingress's own JobsClient, so errors arrive exactly as the ingress turns them
into HTTP. Stopping PostgreSQL gives 503 `state_unavailable` (never a 500, never a hang);
once it is back, the same replica answers again and no job record is lost."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytestmark = pytest.mark.ray

TINY = {"world_size": 1, "cpus_per_worker": 0.25, "epochs": 1}


def _record(job_id: str, status: str) -> Any:
    from service.training.store import JobRecord

    now = time.time()
    return JobRecord(id=job_id, status=status, spec={"world_size": 1, "epochs": 1}, created_at=now, updated_at=now,
                     progress={"epoch": 1, "epochs": 1, "step": 4}, history=[{"epoch": 1, "loss": 0.25}],
                     finished_at=now, owner=None)


def test_a_job_manager_on_postgres_answers_503_while_the_database_is_gone(
        serve_url: str, postgres_server: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    from ray import serve

    from service.deployments.job_manager import JobManager
    from service.contract.errors import GangServeError
    from service.ingress.jobs_client import JobsClient
    from service.training.store import JobStore

    url = postgres_server.create_database()
    seeded = JobStore(url)  # a record written before the service starts (another node, a backup ...)
    seeded.create_job(_record("job-pg0000000001", "SUCCEEDED"))
    seeded.close()
    env = {"GANGSERVE_STATE_DIR": str(tmp_path_factory.mktemp("pg-jobs-state")), "GANGSERVE_DATABASE_URL": url}
    handle = serve.run(
        JobManager.options(ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}}).bind(),
        name="pg-jobs", route_prefix=None,
    )
    jobs = JobsClient(handle, timeout_s=60)

    async def scenario() -> None:
        listed = await jobs.call("list_jobs", 20)
        assert [j["id"] for j in listed["jobs"]] == ["job-pg0000000001"]
        assert listed["jobs"][0]["history"] == [{"epoch": 1, "loss": 0.25, "eval_loss": None}]
        postgres_server.stop()
        try:
            calls = [
                ("list_jobs", (20,)),                                   # GET /train
                ("get_job", ("job-pg0000000001",)),                     # GET /train/{id}
                ("submit", ({"model": {"kind": "linear"}, **TINY},)),   # POST /train
                ("resolve_weights", ("job-pg0000000001",)),             # POST /weights {"job_id"}
                ("list_datasets", ()),                                  # GET /datasets
            ]
            for method, args in calls:
                started = time.monotonic()
                with pytest.raises(GangServeError) as info:
                    await jobs.call(method, *args)
                assert time.monotonic() - started < 30
                assert (info.value.status, info.value.code) == (503, "state_unavailable"), info.value.message
                assert info.value.retry_after_s == 5.0
                assert "postgresql://***@127.0.0.1" in info.value.message
                assert "s3cret" not in info.value.message
        finally:
            postgres_server.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                listed = await jobs.call("list_jobs", 20)
                break
            except GangServeError as exc:
                assert exc.code == "state_unavailable" and time.monotonic() < deadline, exc.message
                await asyncio.sleep(0.5)
        # Nothing lost, and the refused submit left no record (nor a run actor).
        assert [j["id"] for j in listed["jobs"]] == ["job-pg0000000001"]
        assert (await jobs.call("get_job", "job-pg0000000001"))["status"] == "SUCCEEDED"
        assert (await jobs.call("list_datasets")) == {"datasets": []}

    try:
        asyncio.run(scenario())
    finally:
        serve.delete("pg-jobs")
        postgres_server.drop_database(url)
