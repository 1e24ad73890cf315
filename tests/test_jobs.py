"""service.training.jobs.Jobs built from its dependencies, without Ray: a real SQLite job
store and a real artifact store in a tmp dir, the served weights record on the same
database; the run actors, the cluster's resources and the clock are stand-ins the test
drives (they are dependencies, not what is under test). One `poll_round` at a time, so each
test says exactly what the runs answered."""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from service.cluster.placement import ClusterSnapshot
from service.contract.errors import GangServeError
from service.state.artifacts import ArtifactStore, open_store
from service.training.jobs import Jobs
from service.training.lifecycle import ActorDied, Answered, Observation, TimedOut
from service.training.run_snapshot import EpochEntry, FinalCheckpoint, LogLine, Progress, ResumeState, RunSnapshot
from service.training.status import JobStatus
from service.config.builder_args import TrainingLimits
from service.training.run_actors import RunActors
from service.training.store import JobRecord, JobStore
from service.config.tunables import TrainingTunables
from service.weights.record import WeightsRecord

pytestmark = pytest.mark.unit

LINEAR = {"model": {"kind": "linear"}, "dataset": {"samples": 64}, "epochs": 2, "schedule_timeout_s": 60}
ATTENTION = {"model": {"kind": "attention", "embed_dim": 16, "num_heads": 2}, "dataset": {"samples": 64}}
NODES = ClusterSnapshot(totals=[{"CPU": 4.0}], free=[{"CPU": 4.0}])


class FakeClock:
    """Time moves only when the test says so; sleeps yield to the loop."""

    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.mono = 100.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.mono

    async def sleep(self, seconds: float) -> None:
        self.mono += seconds
        self.now += seconds
        await asyncio.sleep(0.01)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.mono += seconds


class FakeRuns(RunActors):
    """Run actors that are entries of a dict: `answer[job]` is what the next poll observes."""

    def __init__(self) -> None:
        super().__init__("no-node")
        self.launched: list[tuple[str, str | None, str | None, ResumeState | None]] = []
        self.epochs: dict[str, int] = {}  # job -> its spec's epochs (what a real run's progress says)
        self.alive: set[str] = set()
        self.killed: list[str] = []
        self.answer: dict[str, Observation] = {}

    async def launch(self, job_id: str, spec: dict[str, Any], dataset_path: str | None,
                     init_key: str | None, resume: ResumeState | None = None) -> Any:
        self.launched.append((job_id, dataset_path, init_key, resume))
        self.epochs[job_id] = int(spec.get("epochs") or 1)
        self.alive.add(job_id)
        return job_id  # the handle

    async def find(self, job_id: str) -> Any | None:  # type: ignore[override]
        return job_id if job_id in self.alive else None

    async def poll(self, handle: Any, log_seq: int, history_seq: int,  # type: ignore[override]
                   timeout_s: float) -> Observation:
        # A run not yet started: a whole snapshot, as a real run sends it.
        return self.answer.get(handle, Answered(RunSnapshot(JobStatus.PENDING,
                                                            progress=Progress(epochs=self.epochs.get(handle, 1)))))

    async def kill(self, handle: Any) -> None:  # type: ignore[override]
        self.killed.append(handle)
        self.alive.discard(handle)


@dataclasses.dataclass
class World:
    jobs: Jobs
    store: JobStore
    artifacts: ArtifactStore
    runs: FakeRuns
    clock: FakeClock
    tmp: Path

    def run(self, coro: Any) -> Any:
        return asyncio.run(coro)

    def record(self, job_id: str) -> JobRecord:
        found = self.store.get_job(job_id)
        assert found is not None
        return found

    def lines(self, job_id: str) -> list[str]:
        return [line for _, line in self.store.tail_logs(job_id, 100)]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    store = JobStore(tmp_path / "jobs.sqlite")
    artifacts = open_store(str(tmp_path / "artifacts"), local_state=tmp_path)
    clock, runs = FakeClock(), FakeRuns()
    jobs = Jobs(store=store, artifacts=artifacts,
                weights=WeightsRecord(tmp_path, store.database), limits=TrainingLimits(max_runtime_s=3600),
                runs=runs, clock=clock, cluster=lambda: NODES, app="app",
                tunables=TrainingTunables(max_missed_polls=2, max_resumes=1))
    yield World(jobs, store, artifacts, runs, clock, tmp_path)
    store.close()


RUNNING = RunSnapshot(JobStatus.RUNNING, started_at=1_000_001.0, attempts=1, progress=Progress(1, 2, 4, 0.5))


def running(**moved: Any) -> Answered:
    """A run in its first attempt after epoch 1 of 2, with `moved` on top."""
    return Answered(dataclasses.replace(RUNNING, **moved))


def test_a_job_is_admitted_polled_and_ends_with_its_runs_outcome(world: World) -> None:
    job = world.run(world.jobs.submit(LINEAR))
    assert job["status"] == "PENDING" and job["reason"].startswith("waiting for 2 x {CPU: 0.5} (PACK)")
    assert world.runs.launched == [(job["id"], None, None, None)]
    assert world.record(job["id"]).owner == world.jobs.manager_id
    assert world.lines(job["id"])[0].startswith(f"submitted by {world.jobs.manager_id}: ")

    world.runs.answer[job["id"]] = running(logs=(LogLine(1, 1_000_001.0, "[rank 0] epoch 1"),), history_seq=1,
                                           history=(EpochEntry(1, 0.5, 0.6, 1_000_002.0),))
    world.run(world.jobs.poll_round())
    record = world.record(job["id"])
    assert record.status == "RUNNING" and record.reason is None and record.attempts == 1
    assert record.history == [{"epoch": 1, "loss": 0.5, "eval_loss": 0.6}]
    assert "[rank 0] epoch 1" in world.lines(job["id"])

    world.runs.answer[job["id"]] = running(status=JobStatus.SUCCEEDED, finished_at=1_000_009.0, checkpoint=FinalCheckpoint(
        path=f"checkpoints/{job['id']}.safetensors", url=f"/train/{job['id']}/checkpoint", format="linear", bytes=64))
    world.run(world.jobs.poll_round())
    assert world.record(job["id"]).status == "SUCCEEDED"
    assert world.runs.killed == [job["id"]]  # its outcome is recorded: the actor is released
    world.runs.answer.clear()
    world.run(world.jobs.poll_round())  # no longer polled
    assert world.record(job["id"]).status == "SUCCEEDED"


def test_a_run_that_stops_answering_fails_after_max_missed_polls(world: World) -> None:
    job_id = world.run(world.jobs.submit(LINEAR))["id"]
    world.runs.answer[job_id] = TimedOut()
    world.run(world.jobs.poll_round())
    assert world.record(job_id).status == "PENDING" and not world.runs.killed
    world.run(world.jobs.poll_round())
    record = world.record(job_id)
    assert record.status == "FAILED" and record.error == "the run actor did not answer 2 polls in a row; stopped it"
    assert world.runs.killed == [job_id]
    assert world.lines(job_id)[-1] == f"FAILED: {record.error}"


def test_a_dead_run_is_resumed_then_failed_past_max_resumes(world: World) -> None:
    job_id = world.run(world.jobs.submit(LINEAR))["id"]
    world.runs.answer[job_id] = running()
    world.run(world.jobs.poll_round())
    world.runs.answer[job_id] = ActorDied("ActorDiedError")
    world.run(world.jobs.poll_round())
    record = world.record(job_id)
    assert record.status == "RUNNING" and record.resumes == 1
    assert world.runs.launched[-1] == (job_id, None, None, ResumeState(
        attempts=1, started_at=1_000_001.0, progress=Progress(1, 2, 4, 0.5), resumed_from_epoch=None))
    assert any("the run's actor died (ActorDiedError) while the job was RUNNING" in line
               and "(resume 1/1)" in line for line in world.lines(job_id))

    world.run(world.jobs.poll_round())  # the resumed run died too
    record = world.record(job_id)
    assert record.status == "FAILED" and record.error == (
        "the run's actor died (ActorDiedError) while the job was RUNNING; its run is gone and was already "
        "resumed 1 time(s) (limit 1)")


def test_a_resumed_run_restores_its_checkpoints_epochs_and_each_epoch_is_timed_once(world: World) -> None:
    """A resumed run first reports again the epochs its checkpoint holds (the runner's
    history_restored), then the epochs it trains: the record's history is every epoch once,
    and gangserve_training_epoch_seconds counts each epoch once."""
    def timed() -> int:
        snap = world.run(world.jobs.metrics())["gangserve_training_epoch_seconds"]
        return sum(int(hist["c"]) for _, hist in snap)

    job_id = world.run(world.jobs.submit({**LINEAR, "epochs": 3}))["id"]
    first, second, third = (EpochEntry(1, 0.5, None, 1_000_003.0), EpochEntry(2, 0.25, None, 1_000_005.0),
                            EpochEntry(3, 0.125, None, 1_000_009.0))
    before = timed()
    world.runs.answer[job_id] = running(history=(first, second), history_seq=2)
    world.run(world.jobs.poll_round())
    assert timed() == before + 2
    world.runs.answer[job_id] = ActorDied("ActorDiedError")
    world.run(world.jobs.poll_round())
    assert world.record(job_id).resumes == 1
    world.runs.answer[job_id] = running(history=(first, second, third), history_seq=3, attempts=2)
    world.run(world.jobs.poll_round())
    assert [h["epoch"] for h in world.record(job_id).history] == [1, 2, 3]
    assert timed() == before + 3  # epoch 3 only: epochs 1 and 2 were timed when first reported


def test_past_max_runtime_or_schedule_timeout_the_job_is_stopped_and_failed(world: World) -> None:
    late = world.run(world.jobs.submit(LINEAR))["id"]  # schedule_timeout_s 60
    world.clock.advance(61)
    world.run(world.jobs.poll_round())
    assert world.record(late).status == "FAILED"
    assert world.record(late).error.startswith("not scheduled within schedule_timeout_s=60: still waiting for")

    slow = world.run(world.jobs.submit(LINEAR))["id"]
    world.runs.answer[slow] = running()
    world.run(world.jobs.poll_round())
    world.clock.advance(3601)
    world.run(world.jobs.poll_round())
    record = world.record(slow)
    assert record.status == "FAILED" and record.error.startswith("exceeded max_runtime_s=3600: 3601s since submission")
    assert world.runs.killed == [late, slow]


def test_an_orphan_is_adopted_at_open_and_resumed_when_its_run_is_gone(world: World) -> None:
    now = world.clock.now
    world.store.create_job(JobRecord(id="job-orphan", status="RUNNING", spec=LINEAR, created_at=now, updated_at=now,
                                     progress={"epoch": 1, "epochs": 2, "step": 3}, owner="mgr-dead"))
    with pytest.raises(RuntimeError, match="not started"):
        world.run(world.jobs.check_health())

    async def scenario() -> None:
        await world.jobs.open()
        try:
            await world.jobs.check_health()
        finally:
            await world.jobs.close()

    world.run(scenario())
    record = world.record("job-orphan")
    assert record.owner == world.jobs.manager_id and record.resumes == 1 and record.status == "RUNNING"
    assert world.runs.launched[0][0] == "job-orphan"
    assert any("service restarted while the job was RUNNING" in line for line in world.lines("job-orphan"))


def test_cancel_delete_and_what_post_weights_loads(world: World) -> None:
    linear = world.run(world.jobs.submit(LINEAR))["id"]
    assert world.run(world.jobs.cancel(linear))["status"] == "CANCELLED" and world.runs.killed == [linear]
    with pytest.raises(GangServeError) as refused:
        world.run(world.jobs.cancel(linear))
    assert refused.value.code == "job_finished"
    with pytest.raises(GangServeError) as refused:
        world.run(world.jobs.resolve_weights(job_id=linear))
    assert refused.value.code == "checkpoint_mismatch"

    attention = world.run(world.jobs.submit(ATTENTION))["id"]
    with pytest.raises(GangServeError) as refused:
        world.run(world.jobs.resolve_weights(job_id=attention))
    assert refused.value.code == "no_checkpoint" and "status PENDING" in refused.value.message
    key = f"checkpoints/{attention}.safetensors"
    world.runs.answer[attention] = running(status=JobStatus.SUCCEEDED, checkpoint=FinalCheckpoint(
        path=key, url=f"/train/{attention}/checkpoint", format="dense-attention", bytes=7))
    world.run(world.jobs.poll_round())
    with pytest.raises(GangServeError) as refused:
        world.run(world.jobs.checkpoint_key(attention))
    assert refused.value.code == "checkpoint_not_found"  # recorded, but not in the store
    world.artifacts.write_bytes(key, b"weights")
    assert world.run(world.jobs.checkpoint_key(attention)) == key
    assert world.run(world.jobs.resolve_weights(job_id=attention)) == {
        "path": key, "job_id": attention, "embed_dim": 16, "num_heads": 2}
    assert world.run(world.jobs.resolve_weights(checkpoint=key)) == {"path": key, "job_id": None}
    for kwargs, code in (({}, "invalid_request"), ({"job_id": attention, "checkpoint": key}, "invalid_request"),
                         ({"checkpoint": "../outside.safetensors"}, "path_outside_state_dir"),
                         ({"checkpoint": "checkpoints/none.safetensors"}, "checkpoint_not_found")):
        with pytest.raises(GangServeError) as refused:
            world.run(world.jobs.resolve_weights(**kwargs))
        assert refused.value.code == code, kwargs

    deleted = world.run(world.jobs.delete_job(attention))
    assert deleted == {"id": attention, "deleted": True, "status": "SUCCEEDED", "freed_bytes": len(b"weights")}
    assert world.store.get_job(attention) is None
    assert [j["id"] for j in world.run(world.jobs.list_jobs())["jobs"]] == [linear]


def test_a_job_trains_on_an_uploaded_dataset_that_stays_while_the_job_is_active(world: World) -> None:
    x = np.random.default_rng(0).standard_normal((64, 10)).astype("float32")
    uploaded = world.run(world.jobs.upload_dataset(st_save({"inputs": x, "targets": x[:, :1]})))
    key = f"datasets/{uploaded['id']}.safetensors"
    assert world.artifacts.exists(key)
    assert world.run(world.jobs.list_datasets()) == {"datasets": [uploaded]}
    spec = {**LINEAR, "dataset": {"kind": "uploaded", "id": uploaded["id"]}}
    with pytest.raises(GangServeError) as refused:
        world.run(world.jobs.submit({**spec, "model": {"kind": "linear", "in_features": 3}}))
    assert refused.value.code == "dataset_mismatch"

    job_id = world.run(world.jobs.submit(spec))["id"]
    assert world.runs.launched == [(job_id, key, None, None)]  # the workers read it by its key
    world.runs.answer[job_id] = ActorDied("ActorDiedError")
    world.run(world.jobs.poll_round())
    assert world.runs.launched[-1][:2] == (job_id, key)  # the resumed run reads the same dataset
    with pytest.raises(GangServeError) as refused:
        world.run(world.jobs.delete_dataset(uploaded["id"]))
    assert refused.value.code == "dataset_in_use" and job_id in refused.value.message

    world.run(world.jobs.cancel(job_id))
    assert world.run(world.jobs.delete_dataset(uploaded["id"]))["deleted"] is True
    assert not world.artifacts.exists(key) and world.run(world.jobs.list_datasets()) == {"datasets": []}
