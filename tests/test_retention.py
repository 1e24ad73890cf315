"""Training quotas and retention: limits on active jobs, workers, GPUs, wall clock, datasets;
DELETE /train/{id} and DELETE /datasets/{id}; the loss history stored incrementally; the job
store's journal mode (WAL on local disks only).

Units first (no Ray), then a JobManager deployed with tight limits on its own state dir
(called through the ingress's own JobsClient, so errors arrive exactly as the ingress
sees them), then the main app over HTTP.
"""
from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import save as st_save

from tests.conftest import undeploy
from tests.helpers import AUTH, assert_error, post, state_dir, wait_done

# ---- units: limits --------------------------------------------------------------------------


@pytest.mark.unit
def test_limits_name_themselves_and_split_alone_from_next_to_others() -> None:
    from service.config.builder_args import TrainingLimits
    from service.contract.errors import GangServeError
    from service.training.limits import (
        ActiveUsage,
        OverLimit,
        QuotaExceeded,
        check_dataset_alone,
        check_dataset_fits,
        check_job_alone,
        check_job_fits,
    )

    limits = TrainingLimits(max_active_jobs=2, max_training_workers=4, max_training_gpus=2, max_runtime_s=60,
                            max_datasets=1, max_dataset_bytes=2000)
    cases: list[tuple[Any, type[GangServeError], str]] = [
        (lambda: check_job_alone(limits, 5, False, None), OverLimit, "max_training_workers is 4"),
        (lambda: check_job_alone(limits, 3, True, None), OverLimit, "max_training_gpus is 2"),
        (lambda: check_job_alone(limits, 1, False, 61), OverLimit, "max_runtime_s is 60"),
        (lambda: check_job_fits(limits, ActiveUsage(2, 2, 0), 1, False), QuotaExceeded, "max_active_jobs is 2"),
        (lambda: check_job_fits(limits, ActiveUsage(1, 3, 0), 2, False), QuotaExceeded, "max_training_workers is 4"),
        (lambda: check_job_fits(limits, ActiveUsage(1, 1, 1), 2, True), QuotaExceeded, "max_training_gpus is 2"),
        (lambda: check_dataset_alone(limits, 16, 17, 10), OverLimit, "max_seq_len is 16"),
        (lambda: check_dataset_alone(limits, 16, None, 2001), OverLimit, "max_dataset_bytes is 2000"),
        (lambda: check_dataset_fits(limits, 1, 10, 10), QuotaExceeded, "max_datasets is 1"),
        (lambda: check_dataset_fits(limits, 0, 1900, 101), QuotaExceeded, "max_dataset_bytes is 2000"),
    ]
    for call, kind, needle in cases:
        with pytest.raises(kind) as info:
            call()
        assert needle in info.value.message
        assert (info.value.status, info.value.code) == ((422, "over_limit") if kind is OverLimit
                                                        else (429, "quota_exceeded"))
        assert info.value.retry_after_s is None  # waiting alone frees nothing
    # Exactly at the limit is fine.
    check_job_alone(limits, 4, False, 60)
    check_job_alone(limits, 2, True, None)
    check_job_fits(limits, ActiveUsage(1, 2, 1), 2, False)
    check_dataset_alone(limits, 16, 16, 2000)
    check_dataset_fits(limits, 0, 1000, 1000)


# ---- units: the store -----------------------------------------------------------------------


def _job(i: int, **kw: Any) -> Any:
    from service.training.store import JobRecord

    spec = kw.pop("spec", {"world_size": 1, "use_gpu": False})
    return JobRecord(id=f"job-{i}", status=kw.pop("status", "PENDING"), spec=spec, created_at=i, updated_at=i,
                     progress={"epoch": 0, "epochs": 1, "step": 0}, **kw)


@pytest.mark.unit
def test_admission_is_atomic_across_concurrent_submits(store_url: str) -> None:
    """16 threads (two stores = two writers, like two managers) race for 3 active slots, on
    SQLite and on PostgreSQL."""
    from service.config.builder_args import TrainingLimits
    from service.training.limits import QuotaExceeded, check_job_fits
    from service.training.store import JobStore

    limits = TrainingLimits(max_active_jobs=3)
    stores = [JobStore(store_url), JobStore(store_url)]
    stores[0].create_job(_job(100, status="SUCCEEDED", spec={"world_size": 8}))  # ended: holds nothing
    admitted, refused = [], []
    start = threading.Barrier(16)

    def submit(i: int) -> None:
        start.wait()
        try:
            stores[i % 2].create_job(_job(i, spec={"world_size": 2, "use_gpu": i % 4 == 0}),
                                     lambda usage: check_job_fits(limits, usage, 2, i % 4 == 0))
            admitted.append(i)
        except QuotaExceeded as exc:
            refused.append(exc.message)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 3 and len(refused) == 13, (admitted, refused)
    assert all("3 job(s) are PENDING or RUNNING; max_active_jobs is 3" in m for m in refused)
    usage = stores[1].active_usage()
    assert (usage.jobs, usage.workers) == (3, 6)
    assert usage.gpus == 2 * sum(1 for i in admitted if i % 4 == 0)
    assert {r.id for r in stores[0].list_jobs(50)[0]} == {f"job-{i}" for i in admitted} | {"job-100"}
    for store in stores:
        store.close()


@pytest.mark.unit
def test_a_job_on_a_deleted_dataset_is_refused_and_a_used_dataset_cannot_be_deleted(
        tmp_path: Path, store_url: str) -> None:
    from service.training.store import DatasetInUse, JobStore

    store = JobStore(store_url)
    store.add_dataset("ds-a", {"kind": "linear"}, str(tmp_path / "a"), 10)
    store.add_dataset("ds-b", {"kind": "linear"}, str(tmp_path / "b"), 20)
    assert store.dataset_usage() == (2, 30)
    with pytest.raises(LookupError):
        store.create_job(_job(1, spec={"world_size": 1, "dataset": {"kind": "uploaded", "id": "ds-gone"}}),
                         dataset_id="ds-gone")
    assert store.get_job("job-1") is None
    store.create_job(_job(2, spec={"world_size": 1, "dataset": {"kind": "uploaded", "id": "ds-a"}}), dataset_id="ds-a")
    with pytest.raises(DatasetInUse) as info:
        store.delete_dataset("ds-a")
    assert info.value.job_ids == ["job-2"]
    store.update_job("job-2", status="SUCCEEDED")
    public, path = store.delete_dataset("ds-a")  # the job ended: its dataset may go
    assert public["id"] == "ds-a" and path == str(tmp_path / "a") and store.dataset_usage() == (1, 20)
    with pytest.raises(KeyError):
        store.delete_dataset("ds-a")
    # add_dataset's admission runs in the inserting transaction.
    with pytest.raises(RuntimeError):
        store.add_dataset("ds-c", {}, "c", 5, admit=lambda count, total: (_ for _ in ()).throw(RuntimeError("no")))
    assert store.dataset_usage() == (1, 20)
    store.close()


@pytest.mark.unit
def test_loss_history_is_stored_incrementally(store_url: str) -> None:
    """Each poll stores only the epochs reported since the last one; earlier rows are never
    rewritten. A resumed attempt's re-report of epoch e replaces e and drops later epochs.
    On SQLite and PostgreSQL."""
    from service.state.db import connect
    from service.training.store import JobStore

    store = JobStore(store_url)
    store.create_job(_job(1))
    statements: list[tuple[str, tuple[Any, ...]]] = []
    store.database.trace = lambda sql, params: statements.append((sql, params))  # every statement sent
    other = connect(store_url)  # another connection, to look at the rows as stored
    # The row's physical identity: rewritten rows get a new one.
    identity = "rowid" if other.dialect == "sqlite" else "ctid::text"

    def rowids() -> dict[int, Any]:
        with other.session() as s:
            rows = s.all(f"SELECT epoch, {identity} AS rid FROM job_history WHERE job_id = 'job-1'")
        return {r["epoch"]: r["rid"] for r in rows}

    store.put_history("job-1", [{"epoch": 1, "loss": 4.0, "at": 1.0}, {"epoch": 2, "loss": 3.0, "at": 2.0}])
    first = rowids()
    statements.clear()
    store.put_history("job-1", [{"epoch": 3, "loss": 2.0, "at": 3.0}])  # one new epoch
    writes = [s for s in statements if s[0].lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE"))]
    assert writes == [("DELETE FROM job_history WHERE job_id = ? AND epoch >= ?", ("job-1", 3)),
                      ("INSERT INTO job_history (job_id, epoch, loss, eval_loss, at) VALUES (?, ?, ?, ?, ?)",
                       ("job-1", 3, 2.0, None, 3.0))], writes
    assert {e: r for e, r in rowids().items() if e < 3} == first  # epochs 1-2 untouched
    assert [h["loss"] for h in store.get_job("job-1").history] == [4.0, 3.0, 2.0]
    store.put_history("job-1", [])  # nothing new: nothing written
    # A worker died after epoch 3; the group resumed from the checkpoint of epoch 1.
    store.put_history("job-1", [{"epoch": 2, "loss": 2.5, "at": 4.0}])
    # (no validation reported: each row's eval_loss is null)
    assert store.get_job("job-1").history == [{"epoch": 1, "loss": 4.0, "eval_loss": None, "at": 1.0},
                                              {"epoch": 2, "loss": 2.5, "eval_loss": None, "at": 4.0}]
    assert store.list_jobs(10)[0][0].history == store.get_job("job-1").history
    assert store.get_job("job-1", with_history=False).history == []
    store.database.trace = None
    # The store no longer takes whole histories as a job update.
    with pytest.raises(ValueError, match="history"):
        store.update_job("job-1", history=[])
    # A deleted job's late poll writes nothing (no orphan rows).
    assert store.delete_job("job-1") and not store.delete_job("job-1")
    store.put_history("job-1", [{"epoch": 9, "loss": 1.0}])
    store.append_logs("job-1", [(1, 1.0, "late line")])
    with other.session() as s:
        assert s.value("SELECT COUNT(*) AS n FROM job_history") == 0
        assert s.value("SELECT COUNT(*) AS n FROM job_logs") == 0
    other.close()
    store.close()


# ---- units: journal mode --------------------------------------------------------------------

MOUNTS = """\
/dev/root / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
10.0.0.5:/export /mnt/state nfs4 rw,relatime,vers=4.1 0 0
//files/share /mnt/smb cifs rw 0 0
/dev/sdb1 /mnt/state/local ext4 rw 0 0
sshfs#me@host: /mnt/sshfs fuse.sshfs rw 0 0
10.0.0.6:6789:/ /mnt/ceph ceph rw 0 0
/dev/sdc1 /mnt/with\\040space xfs rw 0 0
"""


@pytest.mark.parametrize(("path", "fstype", "mode"), [
    ("/home/gangserve/state/jobs.sqlite", "ext4", "wal"),
    ("/dev/shm/x/jobs.sqlite", "tmpfs", "wal"),
    ("/mnt/state/jobs.sqlite", "nfs4", "delete"),
    ("/mnt/state/sub/dir/jobs.sqlite", "nfs4", "delete"),
    ("/mnt/state/local/jobs.sqlite", "ext4", "wal"),  # the longest mount point wins
    ("/mnt/stateful/jobs.sqlite", "ext4", "wal"),     # a name prefix is not a mount prefix
    ("/mnt/smb/jobs.sqlite", "cifs", "delete"),
    ("/mnt/sshfs/jobs.sqlite", "fuse.sshfs", "delete"),
    ("/mnt/ceph/jobs.sqlite", "ceph", "delete"),
    ("/mnt/with space/jobs.sqlite", "xfs", "wal"),
])
@pytest.mark.unit
def test_journal_mode_is_wal_only_on_local_file_systems(
        path: str, fstype: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.state.db import filesystem_type, journal_mode_for

    monkeypatch.delenv("GANGSERVE_SQLITE_JOURNAL", raising=False)
    assert filesystem_type(Path(path).parent, MOUNTS) == fstype
    got, why = journal_mode_for(path, MOUNTS)
    assert got == mode and fstype in why


@pytest.mark.unit
def test_the_store_opens_in_the_detected_journal_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real files and the real /proc/mounts: the mode SQLite reports is the one chosen, and
    the override switches an existing WAL database to the rollback journal."""
    from service.state.db import journal_mode_for
    from service.training.store import JobStore

    monkeypatch.delenv("GANGSERVE_SQLITE_JOURNAL", raising=False)
    db = tmp_path / "jobs.sqlite"
    expected, _ = journal_mode_for(db)
    store = JobStore(db)
    assert store.journal_mode == expected
    store.close()
    monkeypatch.setenv("GANGSERVE_SQLITE_JOURNAL", "delete")
    store = JobStore(db)
    assert store.journal_mode == "delete"
    store.create_job(_job(1))
    store.close()
    assert not Path(str(db) + "-wal").exists()
    check = sqlite3.connect(db)
    assert check.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    check.close()


# ---- a JobManager with tight limits, on its own state dir -----------------------------------

TIGHT = {"max_active_jobs": 2, "max_training_workers": 2, "max_training_gpus": 0, "max_runtime_s": 120,
         "max_datasets": 2, "max_dataset_bytes": 64 * 1024}
TIGHT_SEQ_LEN = 16
TINY = {"world_size": 1, "cpus_per_worker": 0.25, "epochs": 10_000}


@pytest.fixture(scope="module")
def tight(serve_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(JobsClient, state dir) of a JobManager deployed with TIGHT limits: the ingress's own
    client, so every refusal arrives as the ingress would turn it into HTTP."""
    from ray import serve

    from service.ingress.jobs_client import JobsClient
    from service.config.builder_args import TrainingLimits
    from service.deployments.job_manager import JobManager

    state = tmp_path_factory.mktemp("tight-state")
    handle = serve.run(
        JobManager.options(ray_actor_options={
            "num_cpus": 0, "runtime_env": {"env_vars": {"GANGSERVE_STATE_DIR": str(state)}}}
        ).bind(TrainingLimits(**TIGHT), TIGHT_SEQ_LEN),
        name="tight-jobs", route_prefix=None,
    )
    yield JobsClient(handle, timeout_s=60), state
    undeploy("tight-jobs")


def _linear_ds(n: int) -> bytes:
    x = np.ones((n, 10), np.float32)
    return st_save({"inputs": x, "targets": x[:, :1]})


async def _refused(call: Any, status: int, code: str, needle: str) -> str:
    from service.contract.errors import GangServeError

    with pytest.raises(GangServeError) as info:
        await call
    assert (info.value.status, info.value.code) == (status, code), info.value.message
    assert needle in info.value.message, info.value.message
    return info.value.message


@pytest.mark.ray
def test_quotas_refuse_with_the_limit_named_and_deletes_give_the_room_back(tight: Any) -> None:
    import ray

    from service.training.run import RUN_NAMESPACE, run_actor_name

    jobs, state = tight

    async def scenario() -> None:
        # Datasets: alone too big or too long (422), then no room next to the stored ones (429).
        await _refused(jobs.call("upload_dataset", _linear_ds(1600)), 422, "over_limit", "max_dataset_bytes is 65536")
        x = np.ones((2, TIGHT_SEQ_LEN + 1, 8), np.float32)
        await _refused(jobs.call("upload_dataset", st_save({"inputs": x, "targets": x})), 422, "over_limit",
                       f"sequence length is {TIGHT_SEQ_LEN + 1}; max_seq_len is {TIGHT_SEQ_LEN}")
        big = await jobs.call("upload_dataset", _linear_ds(800))
        await _refused(jobs.call("upload_dataset", _linear_ds(800)), 429, "quota_exceeded", "max_dataset_bytes")
        small = await jobs.call("upload_dataset", _linear_ds(16))
        await _refused(jobs.call("upload_dataset", _linear_ds(16)), 429, "quota_exceeded", "max_datasets is 2")
        assert len(list((state / "datasets").iterdir())) == 2  # refused uploads left no file
        gone = await jobs.call("delete_dataset", big["id"])
        assert gone == {"id": big["id"], "deleted": True, "freed_bytes": big["bytes"]}
        assert not (state / "datasets" / f"{big['id']}.safetensors").exists()
        await _refused(jobs.call("delete_dataset", big["id"]), 404, "dataset_not_found", big["id"])

        # Jobs: alone over a limit (422) ...
        linear = {"model": {"kind": "linear"}, **TINY}
        await _refused(jobs.call("submit", {**linear, "max_runtime_s": 121}), 422, "over_limit",
                       "the service's max_runtime_s is 120")
        await _refused(jobs.call("submit", {**linear, "world_size": 3}), 422, "over_limit", "max_training_workers is 2")
        await _refused(jobs.call("submit", {**linear, "use_gpu": True}), 422, "over_limit", "max_training_gpus is 0")
        # ... or not next to the active ones (429).
        j1 = await jobs.call("submit", {**linear, "dataset": {"kind": "uploaded", "id": small["id"]}})
        assert j1["spec"]["max_runtime_s"] == 120  # the service's limit, recorded with the job
        await _refused(jobs.call("submit", {**linear, "world_size": 2}), 429, "quota_exceeded",
                       "active jobs hold 1 worker(s), this job needs 2 more; max_training_workers is 2")
        j2 = await jobs.call("submit", {**linear, "max_runtime_s": 2})
        await _refused(jobs.call("submit", linear), 429, "quota_exceeded",
                       "2 job(s) are PENDING or RUNNING; max_active_jobs is 2")
        await _refused(jobs.call("delete_dataset", small["id"]), 409, "dataset_in_use", j1["id"])

        # The wall clock: j2 is stopped and FAILS naming its limit, which frees its slot.
        deadline = time.monotonic() + 90
        while (j := await jobs.call("get_job", j2["id"]))["status"] in ("PENDING", "RUNNING"):
            assert time.monotonic() < deadline, j
            await asyncio.sleep(0.5)
        assert j["status"] == "FAILED" and "exceeded max_runtime_s=2" in j["error"], j
        j3 = await jobs.call("submit", linear)

        # DELETE an active job: cancelled (its run actor goes), then its record is gone.
        deleted = await jobs.call("delete_job", j1["id"])
        assert deleted["deleted"] and deleted["status"] in ("PENDING", "RUNNING"), deleted
        await _refused(jobs.call("get_job", j1["id"]), 404, "job_not_found", j1["id"])
        await _refused(jobs.call("delete_job", j1["id"]), 404, "job_not_found", j1["id"])
        for job in (j3, j2):
            assert (await jobs.call("delete_job", job["id"]))["deleted"]
        deadline = time.monotonic() + 30
        for job in (j1, j2, j3):
            while True:
                try:
                    ray.get_actor(run_actor_name(job["id"]), namespace=RUN_NAMESPACE)
                except ValueError:
                    break
                assert time.monotonic() < deadline, f"run actor of {job['id']} still alive after delete"
                await asyncio.sleep(0.5)
        # The dataset is free again, and so is every slot.
        assert (await jobs.call("delete_dataset", small["id"]))["deleted"]
        assert (await jobs.call("list_datasets")) == {"datasets": []}
        assert (await jobs.call("list_jobs", 200))["jobs"] == []
        # Files a dying run may still write are swept again shortly after the delete.
        while any((state / "runs" / job["id"]).exists() for job in (j1, j2, j3)):
            assert time.monotonic() < deadline + 30, sorted(p.name for p in (state / "runs").iterdir())
            await asyncio.sleep(1)

    asyncio.run(scenario())


# ---- the main app over HTTP -----------------------------------------------------------------

@pytest.mark.parametrize(("body", "needle"), [
    ({"world_size": 64}, "max_training_workers is 32"),
    ({"world_size": 9, "use_gpu": True}, "max_training_gpus is 8"),
    ({"max_runtime_s": 10**6}, "the service's max_runtime_s is 21600"),
])
@pytest.mark.ray
def test_over_limit_jobs_are_422_naming_the_limit(app_url: str, body: dict[str, Any], needle: str) -> None:
    assert needle in assert_error(post(app_url, "/train", body), 422, "over_limit")["error"]


@pytest.mark.ray
def test_uploaded_sequences_are_bounded_by_max_seq_len(app_url: str) -> None:
    x = np.zeros((1, 4097, 8), np.float32)
    reply = httpx.post(app_url + "/datasets", content=st_save({"inputs": x, "targets": x}), timeout=60,
                       headers={**AUTH, "content-type": "application/x-safetensors"})
    assert "max_seq_len is 4096" in assert_error(reply, 422, "over_limit")["error"]


@pytest.mark.ray
def test_delete_routes_name_unknown_ids(app_url: str) -> None:
    assert_error(httpx.delete(app_url + "/train/job-000000000000", headers=AUTH, timeout=30), 404, "job_not_found")
    assert_error(httpx.delete(app_url + "/datasets/ds-000000000000", headers=AUTH, timeout=30), 404,
                 "dataset_not_found")
    assert_error(httpx.delete(app_url + "/datasets/ds-NOT-AN-ID", headers=AUTH, timeout=30), 404, "dataset_not_found")


@pytest.mark.ray
def test_deleting_a_finished_job_removes_its_record_logs_run_and_checkpoint(app_url: str) -> None:
    reply = post(app_url, "/train", {"model": {"kind": "linear"}, "dataset": {"samples": 64}, "world_size": 1,
                                     "cpus_per_worker": 0.25, "epochs": 2})
    assert reply.status_code == 202, reply.text
    job_id = reply.json()["id"]
    assert reply.json()["spec"]["max_runtime_s"] == 21600  # the default limit, recorded with the job
    job = wait_done(app_url, job_id, 300)
    assert job["status"] == "SUCCEEDED" and [h["epoch"] for h in job["history"]] == [1, 2], job
    checkpoint, run = state_dir() / "checkpoints" / f"{job_id}.safetensors", state_dir() / "runs" / job_id
    assert checkpoint.is_file() and run.is_dir()
    size = checkpoint.stat().st_size

    reply = httpx.delete(f"{app_url}/train/{job_id}", headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    doc = reply.json()
    assert (doc["id"], doc["deleted"], doc["status"]) == (job_id, True, "SUCCEEDED") and doc["freed_bytes"] > size
    assert not checkpoint.exists() and not run.exists()
    for path in ("", "/logs", "/checkpoint"):
        assert_error(httpx.get(f"{app_url}/train/{job_id}{path}", headers=AUTH, timeout=30), 404, "job_not_found")
    listed = httpx.get(app_url + "/train", params={"limit": 200}, headers=AUTH, timeout=30).json()["jobs"]
    assert job_id not in [j["id"] for j in listed]
    assert_error(httpx.delete(f"{app_url}/train/{job_id}", headers=AUTH, timeout=30), 404, "job_not_found")
