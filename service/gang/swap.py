"""The weights swap: every rank's shard replaced by a new recorded version, atomically.

The gang serves one recorded version (`ServedWeights`, see service.weights.served) at a time.
Every rank holds the version number of its weights, and every step's header carries the
version the gang expects: a rank that disagrees poisons its contribution and refuses the
step, so no answer is ever computed from mixed versions.

A swap runs on the sequencer like a request (earlier requests finish on the old weights,
later ones see the new), in three phases: stage the new shard on every rank (any failure:
the staged shards are discarded and the old weights stay in force everywhere), then
`record()` (durably assigns the new version; after staging succeeded everywhere), then
commit that version on every rank. A failed commit marks the gang BROKEN: the rebuild loads
the recorded version, never a mix. Staging and recording may outlast the control group's
timeout, so the runner sends heartbeats while they run.
"""
from __future__ import annotations

import logging
from typing import Callable

from service.config.builder_args import ModelConfig
from service.contract.errors import Conflict, ErrorCode, GangUnavailable
from service.contract.gang_status import GangState
from service.gang.failures import PeerCallFailed, first_line
from service.gang.lifecycle import Lifecycle
from service.gang.peers import PeerGroup, Settled
from service.gang.rank import RankWorker
from service.gang.runner import Health, Members, StepRunner
from service.weights.served import ServedWeights

log = logging.getLogger("gangserve.gang")


class WeightsSwap:
    """Stages, records and commits a new weights version on every rank (sequencer only)."""

    def __init__(self, health: Health, members: Members, runner: StepRunner, lifecycle: Lifecycle) -> None:
        self._health = health
        self._members = members
        self._runner = runner
        self._lifecycle = lifecycle

    def swap(self, model: ModelConfig, record: Callable[[], ServedWeights]) -> ServedWeights:
        self._health.require_ready()
        root, peers = self._members.require_root(), self._members.peers
        assert peers is not None
        # Phase 1: stage everywhere; the old weights stay in force until every rank has staged.
        root_bytes, staged = self._stage(root, peers, model)
        # Phase 2: the new version is durable before any rank serves it.
        try:
            weights = self._runner.wait_heartbeating(record)
        except Exception:
            self._discard_staged(root, peers)
            raise
        # Phase 3: commit everywhere. Steps are sequenced behind this, so none can run in between.
        calls = peers.submit("commit_weights", weights.version)
        failures = []
        try:
            root.commit_weights(weights.version)
        except Exception as exc:
            failures.append(f"rank 0: {type(exc).__name__}: {first_line(exc)}")
        failures += peers.collect(calls, stage="commit weights", collect="settle").failures
        # The version every step now expects (and a rebuild would load).
        self._lifecycle.serve(weights, [root_bytes, *(staged.results[r] for r in sorted(staged.results))])
        if failures:
            self._health.mark_broken(f"commit of weights version {weights.version} failed: {'; '.join(failures)}")
            raise GangUnavailable(
                f"weights version {weights.version} was recorded but its commit failed on "
                f"{'; '.join(failures)}; the gang is being rebuilt with version {weights.version}",
                code=ErrorCode.WEIGHTS_COMMIT_FAILED,
            )
        log.info("weights swapped to version %d (%s, %s)", weights.version, weights.source, weights.description)
        return weights

    def _stage(self, root: RankWorker, peers: PeerGroup, model: ModelConfig) -> tuple[int, Settled]:
        """Every rank's new shard staged (rank 0's bytes, the peers' answers); any failure:
        every staged shard discarded, and Conflict (or GangUnavailable when a rank died)."""
        calls = peers.submit("stage_weights", model)
        failures: list[str] = []
        root_bytes = 0
        try:  # (staging never touches a group, so it may run beside the heartbeats)
            root_bytes = self._runner.wait_heartbeating(lambda: root.stage_weights(model))
        except Exception as exc:
            failures.append(f"rank 0: {type(exc).__name__}: {first_line(exc)}")
        staged = peers.collect(calls, stage="stage weights", collect="settle")
        failures += staged.failures
        if not failures:
            return root_bytes, staged
        self._discard_staged(root, peers)
        version = self._lifecycle.weights_version
        if self._health.state is GangState.BROKEN:  # a rank died meanwhile: nothing to keep serving
            raise GangUnavailable(
                f"weights not swapped: {'; '.join(failures)}; the gang is being rebuilt with "
                f"version {version}", code=ErrorCode.GANG_BROKEN,
            )
        raise Conflict(
            f"weights not swapped, every rank still serves version {version}: staging failed on "
            f"{'; '.join(failures)}", code=ErrorCode.WEIGHTS_STAGE_FAILED,
        )

    def _discard_staged(self, root: RankWorker, peers: PeerGroup) -> None:
        root.discard_staged()
        try:
            peers.call("discard_staged", stage="discard staged weights")
        except PeerCallFailed as exc:
            self._health.mark_broken(f"a rank failed while discarding staged weights: {first_line(exc)}")
