"""A training run's DDP worker group: one placement group, one `TrainWorker` actor per rank,
one process group among them; started for one attempt, run to its end or to its first
failure, and shut down. The run actor (service.training.run) makes a new one per attempt.

    placement group   [the job's worker bundle] x world size, the job's strategy (PACK,
                      SPREAD, STRICT_SPREAD); waited for as long as the cluster lacks room
                      (the job stays PENDING and says so in its log; cancel kills the run)
    workers           TrainWorker actors, rank r in bundle r; rank 0 hosts the rendezvous
                      store (its node's Ray address, an OS-chosen port: no port race)
    train             every rank's `train` call; the first that fails (an exception in the
                      loop, a dead process, a lost node) fails the attempt at once, and the
                      others are killed, not left waiting in a collective

Why our own and not Ray Train's TorchTrainer: a run needs exactly this, and Ray Train starts
four more processes per run around it (its controller, a placement-group cleaner, a dataset
manager, a synchronization actor), each a Python interpreter with Ray imported: a five-epoch
two-rank linear job took ~15 s and ~22 core-seconds there against ~5.2 s and ~6.8 with this group
(bench/NOTES.md). Its checkpoint handling (storage, the newest registered checkpoint, what a
restart resumes from) is service.training.epoch_checkpoints here, in the artifact store.

Ownership: the run actor creates the placement group and the workers, so they share its
fate: a cancel (`ray.kill` of the run actor) takes them with it, and Ray removes the placement
group of a detached actor that dies.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.training.spec import JobSpec
from service.training.worker_reports import WorkerLoop

log = logging.getLogger("gangserve.training")

# How often a group that waits for room says so in the run's log.
WAITING_NOTE_S = 30.0
# After a rank's failure, how long the others' outcomes are gathered before the attempt fails.
FAILURE_GRACE_S = 2.0


class AttemptFailed(RuntimeError):
    """One attempt's worker group failed: a rank raised, died, or the group could not form."""


@dataclass(frozen=True)
class _Members:
    placement: PlacementGroup
    workers: tuple[Any, ...]  # TrainWorker handles, by rank


class WorkerGroup:
    """One attempt's workers for `spec`; `note` writes a line to the run's log."""

    def __init__(self, spec: JobSpec, group_timeout_s: float, note: Callable[[str], None]) -> None:
        self._spec = spec
        self._timeout_s = group_timeout_s
        self._note = note
        self._members: _Members | None = None

    def run(self, loop: WorkerLoop) -> None:
        """Place the group, start it, and train to the end; AttemptFailed naming the rank and
        its error at the first failure. The caller shuts the group down either way."""
        members = self._place()
        world = len(members.workers)
        try:
            rendezvous = ray.get(members.workers[0].open_store.remote(world, self._timeout_s), timeout=self._timeout_s)
        except (RayActorError, RayTaskError, GetTimeoutError) as exc:
            raise AttemptFailed(f"rank 0 did not start within {self._timeout_s:.0f}s: {short_error(exc)}") from exc
        calls = {w.train.remote(loop, rank, world, rendezvous): rank for rank, w in enumerate(members.workers)}
        pending = list(calls)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except (RayActorError, RayTaskError) as exc:
                failed = {calls[done[0]]: exc}
                # A rank that dies breaks its peers' collectives too, and either may be seen
                # first: gather what the others say within a short bound, so the error names
                # the rank that died, not only the one whose all-reduce broke.
                settled, _ = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S) if pending else ([], [])
                for ref in settled:
                    try:
                        ray.get(ref)
                    except (RayActorError, RayTaskError) as other:
                        failed[calls[ref]] = other
                raise AttemptFailed(describe_failures(failed)) from exc

    def _place(self) -> _Members:
        spec = self._spec
        bundle = spec.worker_bundle()
        pg = placement_group([dict(bundle)] * spec.world_size, strategy=spec.placement_strategy)
        self._members = _Members(pg, ())
        waited = 0.0
        while not pg.wait(timeout_seconds=WAITING_NOTE_S):
            waited += WAITING_NOTE_S
            self._note(f"waiting {waited:.0f}s so far for room for {spec.world_size} worker(s) x {bundle} "
                       f"({spec.placement_strategy}); the job stays PENDING until the cluster has it")
        remote = ray.remote(TrainWorker)
        workers = tuple(
            remote.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(spec.world_size)
        )
        self._members = _Members(pg, workers)
        return self._members

    def shutdown(self) -> None:
        """Kill the workers and remove the placement group (idempotent; never raises)."""
        members, self._members = self._members, None
        if members is None:
            return
        for worker in members.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already is fine
                pass
        try:
            remove_placement_group(members.placement)
        except Exception as exc:  # noqa: BLE001 - the run's own end removes it with the run actor
            log.warning("could not remove a worker group's placement group: %s", exc)


class TrainWorker:
    """One rank of a run's worker group, a Ray actor in one bundle of the group's placement
    group. Rank 0 first hosts the rendezvous store (`open_store`); then every rank's `train`
    joins the group and runs the loop to its end. The training code (torch) is imported in
    the worker's process when it is called: the run actor that creates the workers never
    imports torch."""

    def __init__(self) -> None:
        self._store: Any = None  # rank 0's torch TCPStore, kept alive for the group's life

    def open_store(self, world: int, timeout_s: float) -> tuple[str, int]:
        """Rank 0 only: host the group's rendezvous store; its (address, port)."""
        from service.training.runner import open_store

        self._store, address = open_store(world, timeout_s)
        return address

    def train(self, loop: WorkerLoop, rank: int, world: int, rendezvous: tuple[str, int]) -> None:
        """Join the process group at `rendezvous` and train (service.training.runner.run_rank)."""
        from service.training.runner import run_rank

        run_rank(loop, rank, world, rendezvous, self._store)


def describe_failures(failed: dict[int, BaseException]) -> str:
    """The failed ranks, those whose process died first ("rank 1 died: ..."), then those that
    raised ("rank 0 failed: ..."), each with its most specific error line."""
    died = sorted(r for r, e in failed.items() if isinstance(e, RayActorError))
    raised = sorted(r for r in failed if r not in died)
    # Ray's text for a dead actor goes on to guess causes (OOM, `ray stop`); its first part says what happened.
    return "; ".join([f"rank {r} died: {short_error(failed[r]).split(' Worker exit detail:')[0]}" for r in died]
                     + [f"rank {r} failed: {short_error(failed[r])}" for r in raised])


def short_error(exc: BaseException) -> str:
    """The most specific 'Type: message' line of a (possibly nested) Ray error."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) and " " not in head:
            return line[:500]
    return (lines[-1] if lines else type(exc).__name__)[:500]
