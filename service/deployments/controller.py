"""Controller: the one owner of an app's shared state (one replica, no CPU reserved).

It holds two things, and is the only writer of each:
- the live fleet view (service.state.fleet), in memory: every GangServer replica reports
  its status to it and every ingress replica reads `/gangs`, `/readyz`, weights rollouts
  and the other replicas' metrics from it;
- the durable served-weights record (service.weights.record, table `served_weights`):
  every GangServer asks it what to load at bring-up and to record a swapped version.

It also watches every gang it has heard from: a ping (`__ray_ready__`, Ray's built-in
no-op method) to the gang's replica actor every `tunables.watch_interval_s`. A replica whose
process died fails that ping at once (Ray reports a dead actor's calls in milliseconds),
so the gang stops counting as ready within a ping period, not after Serve's health
check or a stale report. A ping that fails because the actor's node cannot be reached
marks the gang unreachable until a ping succeeds again.

Ingress replicas follow the fleet view with a long poll (`watch_fleet`, as Serve's own
controller pushes its config to the proxies): it answers at once when the view moved past the
version the caller knows, else when it moves, when a ready gang's last report turns stale,
or after the caller's timeout. The request path reads that pushed view; an inference request
never calls the controller.

When Serve deletes an app with gangs that were never placed, the Controller releases them
(service.cluster.unplaced: Serve would wait out their grace period) and from then on holds no
long poll longer than a watch interval (no gang reports, so the view never moves and every
poll would run its full time): nothing of the app waits when it has nothing to drain.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager
from typing import Iterator

from ray import serve
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from service.cluster import unplaced
from service.metrics.logs import route_logs_to_serve
from service.contract.gang_status import FleetView, GangStatus
from service.weights.record import WeightsRecord
from service.weights.served import ConfigWeights, ServedWeights, Source
from service.state.fleet import Fleet
from service.state.paths import state_dir
from service.config.tunables import Tunables

log = logging.getLogger("gangserve.controller")



@serve.deployment(name="Controller", num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0})
class Controller:
    """The app's fleet view and weights record (see the module docstring)."""

    def __init__(self, tunables: Tunables | None = None) -> None:
        """`tunables`: the app's (AppConfig.tunables; the defaults when None): the fleet
        section's watch and ping times, the state section for the weights record."""
        route_logs_to_serve()
        self._app = serve.get_replica_context().app_name
        tunables = tunables or Tunables()
        self._t = tunables.fleet
        self._fleet = Fleet(tunables=self._t)
        self._started = time.time()
        self._actors: dict[str, ActorHandle] = {}
        self._pings: dict[str, asyncio.Task[None]] = {}
        self._record = WeightsRecord(state_dir(), tunables=tunables.state)
        self._record_lock = asyncio.Lock()  # one write at a time: versions are max + 1
        self._moved = asyncio.Event()  # set (and replaced) whenever the fleet's version moves
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        self._deleting = False  # Serve is deleting the app (seen by _sweep_unplaced)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_unplaced())

    # -- the fleet ----------------------------------------------------------------------------
    async def report_gang(self, replica_id: str, info: GangStatus, metrics: dict[str, list] | None = None,
                          actor: ActorHandle | None = None) -> None:
        """A GangServer replica's report (its /gang description) and metric snapshot."""
        with self._telling():
            self._fleet.report(info, time.time(), metrics)  # under the replica id the report names
        if actor is not None and replica_id not in self._actors and replica_id not in self._fleet.lost:
            self._actors[replica_id] = actor

    async def withdraw_gang(self, replica_id: str) -> None:
        """A GangServer replica is shutting down gracefully."""
        with self._telling():
            self._fleet.withdraw(replica_id)
        self._forget_actor(replica_id)

    async def fleet(self) -> FleetView:
        """Every gang's latest report, how many serve, the lost ones, this view's version."""
        now = time.time()
        with self._telling():  # the view forgets old gangs as it is read
            return self._fleet.view(now, controller_up_s=round(now - self._started, 1))

    async def watch_fleet(self, known_version: int, timeout_s: float) -> FleetView:
        """The fleet view (`fleet()`), once its version differs from `known_version`: at once if
        it does, else when it moves, when a ready gang's report turns stale (a gang that went
        silent), or after `timeout_s` (at most tunables.watch_fleet_max_s), whichever comes first.
        While Serve deletes the app: at most tunables.watch_interval_s, so the replica's drain
        does not wait for it (and the waiting polls answer when the deletion is seen)."""
        hold_s = self._t.watch_interval_s if self._deleting else self._t.watch_fleet_max_s
        deadline = time.monotonic() + min(max(0.0, timeout_s), hold_s)
        while self._fleet.version == known_version:
            wait_s = min(deadline - time.monotonic(), self._fleet.next_stale_s(time.time()))
            if wait_s <= 0:
                break
            try:
                await asyncio.wait_for(self._moved.wait(), wait_s)
            except asyncio.TimeoutError:
                break
            if self._deleting:
                break
        return await self.fleet()

    async def report_metrics(self, source: str, snapshot: dict[str, list]) -> None:
        self._fleet.report_metrics(source, snapshot, time.time())

    async def metrics(self, exclude: str | None = None) -> list[dict[str, list]]:
        return self._fleet.metrics(time.time(), exclude)

    # -- the weights record -------------------------------------------------------------------
    async def reconcile_weights(self, config: ConfigWeights) -> ServedWeights:
        """What a bring-up loads: the newest version, unless the app's config changed."""
        async with self._record_lock:
            return await asyncio.to_thread(self._record.reconcile, self._app, config)

    async def record_weights(self, source: Source, description: str, sha256: str, fingerprint: str,
                             checkpoint: str | None, job_id: str | None = None, eval_loss: float | None = None,
                             rollback_of: int | None = None) -> ServedWeights:
        """Record the app's next weights version (a swap, a reset or a rollback), before any
        rank serves it."""
        async with self._record_lock:
            return await asyncio.to_thread(
                self._record.record, self._app, source, description, sha256=sha256, fingerprint=fingerprint,
                checkpoint=checkpoint, job_id=job_id, eval_loss=eval_loss, rollback_of=rollback_of,
            )

    async def current_weights(self) -> ServedWeights | None:
        return await asyncio.to_thread(self._record.current, self._app)

    async def weights_version(self, version: int) -> ServedWeights | None:
        """Recorded version `version` of the app (what a rollback serves again), or None."""
        return await asyncio.to_thread(self._record.version, self._app, version)

    async def weights_history(self) -> list[ServedWeights]:
        """Every recorded version of the app, oldest first (GET /weights); the newest is in force."""
        return await asyncio.to_thread(self._record.history, self._app)

    @contextmanager
    def _telling(self) -> Iterator[None]:
        """Wake the long polls if what runs inside moved the fleet's version."""
        before = self._fleet.version
        yield
        if self._fleet.version != before:
            self._moved.set()
            self._moved = asyncio.Event()

    # -- watching the gangs ---------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._t.watch_interval_s)
            for replica_id, actor in list(self._actors.items()):
                ping = self._pings.get(replica_id)
                if ping is None or ping.done():
                    self._pings[replica_id] = asyncio.get_running_loop().create_task(self._ping(replica_id, actor))

    async def _sweep_unplaced(self) -> None:
        """While the app runs: look for its never-placed gangs; stop those Serve is stopping,
        and once Serve deletes the app, hold no long poll (service.cluster.unplaced)."""
        while True:
            await asyncio.sleep(self._t.watch_interval_s)
            try:
                found = await asyncio.to_thread(unplaced.sweep, self._app)
            except Exception as exc:  # noqa: BLE001 - the GCS or Serve's controller busy: look again
                log.debug("looking for never-placed gangs failed: %s", exc)
                continue
            if found.released:
                log.info("stopped %d never-placed gang(s) %s of app %s at once (Serve was stopping them)",
                         len(found.released), [g.replica_id for g in found.released], self._app)
            if found.deleting and not self._deleting:
                self._deleting = True
                self._moved.set()  # the long polls answer now
                self._moved = asyncio.Event()

    async def _ping(self, replica_id: str, actor: ActorHandle) -> None:
        try:
            await asyncio.wait_for(actor.__ray_ready__.remote(), self._t.ping_timeout_s)
            with self._telling():
                self._fleet.mark_reachable(replica_id)
        except ActorUnavailableError:
            with self._telling():
                self._fleet.mark_unreachable(replica_id, time.time())
        except (ActorDiedError, RayActorError) as exc:
            log.warning("gang replica %s is gone: %s", replica_id, str(exc).splitlines()[0][:200])
            with self._telling():
                self._fleet.mark_lost(replica_id, "its replica process died (rank 0); Serve is starting a new one",
                                      time.time())
            self._forget_actor(replica_id)
        except asyncio.TimeoutError:
            pass  # busy or stopped: the report's staleness decides
        except Exception as exc:  # noqa: BLE001 - the watcher must outlive any one failure
            log.debug("ping of gang replica %s failed: %s", replica_id, exc)

    def _forget_actor(self, replica_id: str) -> None:
        self._actors.pop(replica_id, None)
        ping = self._pings.pop(replica_id, None)
        if ping is not None and not ping.done() and ping is not asyncio.current_task():
            ping.cancel()
