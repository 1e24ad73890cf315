"""The weights rollout: how an app's gangs move from one served weights version to the next.

Every step of it lives here, and only here drives the gang's swap (tests/test_layout.py):
- `Rollout.weights_at_start()`: what a bring-up serves (the app's record, reconciled with
  the replica's weights config by the Controller);
- `Rollout.reload(checkpoint, ...)`: POST /weights with a job's or a path's checkpoint, and
  `checkpoint=None`: back to the config's weights (`{"reset": true}`);
- `Rollout.rollback(version)`: POST /weights `{"version": N}`, recorded as the next version;
- `Rollout.follow()`: a gang whose app recorded a newer version (another replica swapped)
  moves to it, one supervisor tick at a time;
- `Rollout.recorded()`: what a rebuild loads;
- `wait_for_gangs(...)`: POST /weights' wait until every live gang serves the new version.

One swap, in order: the checkpoint is checked against the serving model and copied into
the artifact store's immutable, content-addressed `weights/` (what the record points to);
then the gang's primitive `swap_weights` stages it on every rank, calls `record` (the
Controller, the record's one writer, assigns the app's next version: durable before any
rank serves it) and commits that version on every rank, all sequenced between steps, so
in-flight requests finish on the old weights and no answer mixes versions. A failure
before the record changes nothing; a failed commit rebuilds the gang with the recorded
version. The other gangs of the app follow the record (`follow`), each swap atomic.

A `Rollout` lives in one GangServer replica, beside its gang; it reaches the Controller
through the `ask` it is given (bounded, every failure a GangServeError). `wait_for_gangs`
runs in the ingress and long-polls the Controller's fleet view. This module imports no gang or
ingress code: the gang comes in as a `SwappableGang`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Protocol

from service.cluster.own_thread import in_own_thread
from service.config.builder_args import ModelConfig
from service.contract.errors import Conflict, ErrorCode, GangServeError, GangStartupError, NotFound
from service.contract.gang_status import FleetView, GangState
from service.state import artifacts
from service.config.tunables import GangTunables
from service.weights.served import (
    ConfigWeights,
    ServedWeights,
    Source,
    WeightsRecordError,
    store_immutable_copy,
    verify_recorded_file,
)

log = logging.getLogger("gangserve.server")
# Slack over a call's own bound for the hop onto the replica's event loop and back (see _swap_to).
_LOOP_HOPS_S = 5.0

# The checkpoint check and the config's hash need torch. They are imported when first called,
# not with this module: the ingress imports this module (wait_for_gangs) and loads no torch
# (tests/test_layout.py), which keeps its replicas' start and memory small.
def _check_checkpoint(path: str, model: ModelConfig) -> None:
    """ValueError unless the file holds exactly the served architecture's tensors, naming each difference."""
    from service.parallel.model import check_checkpoint
    from service.parallel.registry import resolve

    check_checkpoint(resolve(model), path)


def _describe_config_weights(model: ModelConfig) -> ConfigWeights:
    from service.weights.declared import describe_config_weights

    return describe_config_weights(model)


# ask(method, *args, timeout_s=...): one bounded call to the app's Controller.
Ask = Callable[..., Awaitable[Any]]


class SwappableGang(Protocol):
    """What the rollout needs of a gang (service.gang.gang.Gang)."""

    state: GangState
    weights: ServedWeights | None

    @property
    def weights_version(self) -> int: ...

    async def swap_weights(self, model: ModelConfig, record: Callable[[], ServedWeights]) -> ServedWeights: ...


class Rollout:
    """One gang's side of the app's weights rollout (see the module docstring).

    `model`: the builder's model arguments (each version's checkpoint overrides theirs);
    `store`: the artifact store (checkpoints, the immutable copies); `ask`: the Controller;
    `app`: the Serve application's name (in messages). One swap at a time per gang: a
    second waits for the first and is recorded after it."""

    def __init__(self, gang: SwappableGang, model: ModelConfig, store: artifacts.ArtifactStore, ask: Ask,
                 app: str, tunables: GangTunables = GangTunables()) -> None:
        self._t = tunables  # the Controller calls' bounds
        self._gang = gang
        self._model = model
        self._artifacts = store
        self._ask = ask
        self._app = app
        self._config_weights: ConfigWeights | None = None  # set by weights_at_start
        self._lock = asyncio.Lock()  # one swap at a time (the second sees the first's version)

    @property
    def config_weights(self) -> ConfigWeights:
        assert self._config_weights is not None, "weights_at_start() runs before any swap"
        return self._config_weights

    async def weights_at_start(self) -> ServedWeights:
        """The version this replica must serve: the app's record, unless its config changed.
        GangStartupError (`weights_record_broken`) when the recorded file is gone or altered."""
        config = await in_own_thread(_describe_config_weights, self._model)
        weights: ServedWeights = await self._ask("reconcile_weights", config, timeout_s=self._t.controller_timeout_s)
        try:
            await in_own_thread(verify_recorded_file, weights, self._artifacts)
        except WeightsRecordError as exc:
            raise GangStartupError(
                f"{exc}. Restore the file, or start the app with a different weights config "
                "(a changed config wins over the record)",
                code=ErrorCode.WEIGHTS_RECORD_BROKEN,
            ) from None
        self._config_weights = config
        log.info("app %r serves weights version %d (%s: %s, sha256 %s)", self._app, weights.version,
                 weights.source, weights.description, weights.sha256[:16])
        return weights

    async def reload(self, checkpoint: str | None, job_id: str | None = None,
                     eval_loss: float | None = None) -> ServedWeights:
        """Swap to a dense checkpoint (an artifact key, or an absolute local path), or with
        `checkpoint=None` back to the app's configured weights; returns the version now
        served. `eval_loss`: the job's final held-out loss, kept in the record.

        Conflict (409, nothing changes) if its shapes do not fit the serving model or a rank
        cannot stage it; a store outage is a 503; the gang's own refusals pass through."""
        async with self._lock:
            if checkpoint is None:
                config = self.config_weights
                return await self._swap_to(self._model, "config", config.description, config.sha256,
                                           config.checkpoint)
            current = self._model
            try:
                # A local copy (downloaded once, hashed), its header checked, then the
                # immutable copy: I/O, off the event loop.
                local, sha = await in_own_thread(self._artifacts.fetch, checkpoint)
                await in_own_thread(_check_checkpoint, local, current)
                stored, sha = await in_own_thread(store_immutable_copy, local, self._artifacts, sha)
            except (ValueError, OSError) as exc:
                raise Conflict(str(exc), code=ErrorCode.CHECKPOINT_MISMATCH) from None
            description = f"job {job_id}" if job_id else f"checkpoint {checkpoint.rsplit('/', 1)[-1]}"
            return await self._swap_to(current.model_copy(update={"checkpoint": stored}), "swap", description, sha,
                                       stored, job_id, eval_loss)

    async def rollback(self, version: int) -> ServedWeights:
        """Serve recorded version `version` again, recorded as the app's next version
        (`rollback_of = version`, its sha256, job and eval loss); returns it.

        The same atomic swap as `reload`. NotFound (404) for a version never recorded;
        Conflict (409, nothing changes) when its file is gone or altered, does not fit the
        serving model, or it was generated by `init` under an earlier weights config (those
        tensors are not kept: only the current config's can be made again)."""
        async with self._lock:
            target: ServedWeights | None = await self._ask("weights_version", version,
                                                           timeout_s=self._t.controller_timeout_s)
            if target is None:
                raise NotFound(f"no weights version {version} is recorded for app {self._app!r} "
                               "(GET /weights lists them)", code=ErrorCode.WEIGHTS_VERSION_NOT_FOUND)
            config = self.config_weights
            if target.checkpoint is None and target.fingerprint != config.fingerprint:
                raise Conflict(
                    f"weights version {version} ({target.description}) was generated by init under an earlier "
                    f"weights config of this app, which now declares {config.description}; only versions with a "
                    "checkpoint file, and those of the current config, can be served again",
                    code=ErrorCode.WEIGHTS_VERSION_UNAVAILABLE,
                )
            if target.checkpoint is not None:
                try:
                    local = await in_own_thread(self._artifacts.materialize, target.checkpoint, target.sha256)
                except artifacts.ArtifactCorrupt as exc:
                    raise Conflict(f"weights version {version} ({target.description}): {exc}",
                                   code=ErrorCode.WEIGHTS_VERSION_UNAVAILABLE) from None
                except OSError as exc:
                    raise Conflict(f"weights version {version} ({target.description}): its file cannot be read: "
                                   f"{getattr(exc, 'strerror', None) or exc}", code=ErrorCode.WEIGHTS_VERSION_UNAVAILABLE) from None
                try:
                    await in_own_thread(_check_checkpoint, local, self._model)
                except (ValueError, OSError) as exc:
                    raise Conflict(f"weights version {version} ({target.description}): {exc}",
                                   code=ErrorCode.CHECKPOINT_MISMATCH) from None
            # A rollback to a config row of the current config serves the config's weights
            # (source `config`, as a reset does); any other is a swap to a recorded file.
            source: Source = "config" if target.source == "config" and target.fingerprint == config.fingerprint \
                else "swap"
            return await self._swap_to(target.model_config(self._model), source,
                                       f"rollback of {version}: {target.description}", target.sha256,
                                       target.checkpoint, target.job_id, target.eval_loss, rollback_of=version)

    async def _swap_to(self, model: ModelConfig, source: Source, description: str, sha: str,
                       stored: str | None, job_id: str | None = None, eval_loss: float | None = None,
                       rollback_of: int | None = None) -> ServedWeights:
        """Stage `model`'s weights on every rank, record them (the Controller assigns the
        version), commit; the caller holds the swap lock."""
        loop = asyncio.get_running_loop()
        timeout_s = self._t.controller_timeout_s

        def record() -> ServedWeights:
            # Runs on the gang's sequencer thread, after staging succeeded on every rank:
            # the Controller (the record's one writer) assigns the version, through this
            # replica's event loop (where its handles live).
            asking = self._ask("record_weights", source, description, sha, self.config_weights.fingerprint,
                               stored, job_id, eval_loss, rollback_of, timeout_s=timeout_s)
            # `asking` bounds itself by timeout_s; this wait only adds the hops onto the replica's
            # event loop and back, which a busy loop may delay (never unbounded).
            return asyncio.run_coroutine_threadsafe(asking, loop).result(timeout=timeout_s + _LOOP_HOPS_S)

        return await self._gang.swap_weights(model, record)

    async def recorded(self) -> ServedWeights:
        """The app's newest recorded version (what a bring-up loads); falls back to the
        version the gang last held if the record cannot be read right now."""
        try:
            recorded = await self._ask("current_weights", timeout_s=self._t.probe_interval_s * 2)
        except Exception as exc:  # the controller restarts, the database hiccups: keep serving what we had
            log.error("cannot read the weights record (%s); using version %d", exc, self._gang.weights_version)
            recorded = None
        if recorded is None or recorded.fingerprint != self.config_weights.fingerprint:
            # No row (deleted by hand) or written under another config (an older replica
            # of a redeployed app): this replica's own version stands.
            assert self._gang.weights is not None
            return self._gang.weights
        return recorded

    async def follow(self) -> bool:
        """Serve a newer version another replica of this app recorded (multi-replica apps).
        True when a swap was tried (the gang's status changed or says why not): the caller
        reports it. A failed follow leaves the old version in force and is retried at the
        next call."""
        if self._lock.locked():
            return False
        recorded = await self.recorded()
        if recorded.version <= self._gang.weights_version or self._gang.state is not GangState.READY:
            return False
        async with self._lock:
            log.info("following the record: weights version %d -> %d", self._gang.weights_version, recorded.version)
            model = recorded.model_config(self._model)
            try:
                await self._gang.swap_weights(model, lambda: recorded)
            except Exception as exc:
                log.error("could not move to recorded weights version %d: %s", recorded.version, exc)
        return True


async def wait_for_gangs(watch: Callable[[int], Awaitable[FleetView]], version: int, timeout_s: float,
                         retry_s: float = 0.5) -> tuple[bool, list[dict[str, Any]]]:
    """Wait (at most timeout_s) until every live gang of the app serves weights `version`
    or newer; returns (all there, each gang's {replica_id, state, weights_version}).

    `watch(known)`: the Controller's fleet view once its version moved past `known`
    (service.ingress.fleet_client.FleetClient.watch, a long poll): a gang's weights version
    is part of what moves it, so the wait ends when the last gang's report lands, not at a
    poll tick. A view that cannot be read (the Controller restarts; the gangs report again
    within a second) is never taken for "every gang is there": the wait goes on, retried
    every `retry_s`."""
    deadline = time.monotonic() + timeout_s
    known, outcome = -1, []
    while True:
        left = deadline - time.monotonic()
        try:
            view = await asyncio.wait_for(watch(known), max(0.0, left))
        except (GangServeError, asyncio.TimeoutError):
            view = None
        if view is not None:
            known = view.version
            outcome = [{"replica_id": g.replica_id, "state": g.state, "weights_version": g.weights_version}
                       for g in view.gangs]
            if all(g.weights_version >= version for g in view.gangs):
                return True, outcome
        if time.monotonic() >= deadline:
            return False, outcome
        if view is None:
            await asyncio.sleep(min(retry_s, max(0.0, deadline - time.monotonic())))
