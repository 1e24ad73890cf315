"""The warm spare: one idle rank process per gang, adopted by a rebuild for a lost rank.

Creating a rank process is ~95 % of a rebuild on CPUs (Ray starts a worker, the worker
imports torch: 1.3-2.3 s here); adopting a process that already runs takes milliseconds.
The spare is a `RankWorker` with rank -1 in the gang's last peer bundle, reserving no
resources of its own: Ray still pins it to the bundle's node, and the bundle's CPU is held
by the placement group either way, so the adopted rank uses the lost rank's share.

A gang whose sessions read the KV pool in place (service.parallel.paged_kernel) has its spare
load and check the peers' kernel before it counts as warm, so an adopting rebuild does no
more of it than a lookup (the kernel's library is built once per machine, ~1 s, and loaded
by every later process).

Owned by the gang's sequencer thread (start, take, drop); `status()` is read from the event
loop without a Ray call (the spare's describe() is kept as a concurrent future).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Callable

from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.config.builder_args import GangConfig
from service.gang.failures import first_line, kill_quietly
from service.gang.rank import RankInfo
from service.parallel.paged_kernel import KernelShape
from service.contract.gang_status import SpareStatus
from service.config.tunables import GangTunables, StateTunables

log = logging.getLogger("gangserve.gang")


def spare_wanted(cfg: GangConfig) -> bool:
    """One spare per gang of peers on CPUs. A GPU gang gets none: each bundle holds one
    GPU that its rank already holds, and a spare without it has no CUDA device to adopt."""
    return cfg.warm_spare and cfg.world_size > 1 and not cfg.use_gpu


class WarmSpare:
    """At most one idle rank actor, started after a bring-up and handed to the next one."""

    def __init__(self, cfg: GangConfig, placement_group: PlacementGroup | None,
                 actor_class: Callable[..., Any], tunables: GangTunables = GangTunables(),
                 state_tunables: StateTunables = StateTunables()) -> None:
        self._cfg = cfg
        self._tunables = tunables  # handed to the spare rank's constructor, as is:
        self._state_tunables = state_tunables
        self._placement_group = placement_group
        self._actor_class = actor_class  # the Ray actor class of a rank (RankActor)
        self._actor: Any | None = None
        # Its describe() as a concurrent future: done once the spare is warm.
        self._ready: Future | None = None

    def start(self, kernel: KernelShape | None = None, compile_budget_s: float = 0.0) -> None:
        """Start the spare if wanted and none exists. Non-blocking: `take` uses it once warm,
        which is after it compiled `kernel` (the peers' in-place attention; None: nothing to
        compile) within `compile_budget_s` (the actor runs its calls in order: its describe
        answers after the compile)."""
        if not spare_wanted(self._cfg) or self._actor is not None:
            return
        options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0}
        if self._placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._placement_group, placement_group_bundle_index=self._cfg.world_size - 1
            )
        self._actor = self._actor_class.options(**options).remote(
            -1, self._cfg.world_size, use_gpu=False, torch_threads=self._cfg.threads_per_rank,
            tunables=self._tunables, state_tunables=self._state_tunables,
        )
        if kernel is not None:
            self._actor.prewarm_sessions.remote(kernel, compile_budget_s)
        self._ready = self._actor.describe.remote().future()

    def take(self, node_id: str | None) -> Any | None:
        """The spare, handed over, if it is warm (answered its describe) and on `node_id`
        (the node of the bundle the rank goes to); else None (still starting, elsewhere:
        the rank starts a process of its own). A dead spare is dropped."""
        if self._actor is None or self._ready is None or node_id is None or not self._ready.done():
            return None
        try:
            info: RankInfo = self._ready.result(timeout=0)
        except Exception as exc:  # RayActorError & co: its process is gone
            log.warning("the warm spare is gone (%s); starting a new one after this bring-up", first_line(exc))
            self.drop()
            return None
        if info.node_id != node_id:
            return None
        actor, self._actor, self._ready = self._actor, None, None
        return actor

    def drop(self) -> None:
        """Kill the spare, if any."""
        if self._actor is not None:
            kill_quietly(self._actor)
        self._actor = self._ready = None

    def status(self) -> SpareStatus:
        """GET /gang `spare`: none, starting, warm (with its pid) or dead."""
        ready = self._ready
        if self._actor is None or ready is None:
            return SpareStatus(state="none")
        if not ready.done():
            return SpareStatus(state="starting")
        if ready.exception() is not None:
            return SpareStatus(state="dead")
        return SpareStatus(state="warm", pid=ready.result().pid)
