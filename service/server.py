"""GangServer: the Serve deployment that owns the gang. It never parses HTTP.

One replica = one gang. Serve reserves the replica's placement group
(`placement_group_bundles`, one bundle per rank) before the replica starts; the replica
itself is rank 0 in bundle 0 and places ranks 1..N-1 in the other bundles.

Recovery, in two tiers:
1. In-process: a supervisor task probes the peers every `probe_interval_s` and, when the
   gang is BROKEN (a rank died, a collective failed or hung), rebuilds it in the same
   bundles with exponential backoff. This is the fast path: the placement group stays
   reserved, only the rank processes and the process group are new.
2. Serve: after `max_rebuild_attempts` failed rebuilds, `check_health` raises and Serve
   replaces the whole replica (new placement group). If rank 0 itself (this process)
   dies, Serve does the same on its own.
"""
from __future__ import annotations

import asyncio
import logging

import numpy as np
import ray
from ray import serve
from ray.util import get_current_placement_group

from service import shm
from service.config import AppConfig, GangConfig, ModelConfig
from service.errors import Conflict
from service.gang.gang import Gang, GangState
from service.parallel.weights import check_checkpoint

log = logging.getLogger("gangserve.server")

PROBE_INTERVAL_S = 2.0
MAX_REBUILD_ATTEMPTS = 5
MAX_BACKOFF_S = 30.0


@serve.deployment(name="GangServer", health_check_period_s=5, health_check_timeout_s=30)
class GangServer:
    """Owns one Gang; answers inference and status calls from the ingress."""

    async def __init__(self, config: dict) -> None:
        cfg = AppConfig.model_validate(config)
        self._gang = Gang(cfg.part(ModelConfig), cfg.part(GangConfig), get_current_placement_group())
        self._failed_rebuilds = 0
        self._node_id = ray.get_runtime_context().get_node_id()
        try:
            await self._gang.start()
        except Exception:
            self._gang.shutdown()
            raise
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def infer(self, x: np.ndarray) -> np.ndarray:
        """x: [batch, seq, E] float32 (validated by the ingress) -> [batch, seq, E] float32."""
        return await self._gang.infer(x)

    async def infer_shared(self, ref: shm.SharedTensorRef) -> tuple[int, ...]:
        """Same as `infer`, but the tensor travels through /dev/shm (see service.shm).

        Reads the request from the pages `ref` names and writes the output into the same
        pages; only the ref and the reply's shape cross the handle call. Raises
        SharedMemoryUnavailable (the ingress then sends the tensor by value) when `ref`
        lives on another node or is gone.
        """
        view = shm.open_ref(ref, self._node_id)  # [batch, seq, E] float32
        out = await self._gang.infer(view)
        view[...] = out  # the ingress reads the reply from the same pages
        return tuple(int(d) for d in out.shape)

    async def reload_weights(self, checkpoint: str) -> dict[str, object]:
        """Hot-swap to a dense checkpoint (absolute path every rank can read).

        Raises Conflict (409) if its shapes do not fit the serving model; in-flight and
        queued requests are unaffected (the swap is sequenced between them).
        """
        current = self._gang.model_cfg
        try:
            check_checkpoint(checkpoint, current.embed_dim, current.num_heads)
        except (ValueError, OSError) as exc:
            raise Conflict(str(exc), code="checkpoint_mismatch") from None
        new_cfg = current.model_copy(update={"checkpoint": checkpoint})
        await self._gang.reload_weights(new_cfg)
        return self._gang.describe()

    async def describe(self) -> dict[str, object]:
        info = self._gang.describe()
        info["failed_rebuilds"] = self._failed_rebuilds
        return info

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica (and gang)."""
        if self._failed_rebuilds >= MAX_REBUILD_ATTEMPTS:
            raise RuntimeError(
                f"gang could not be rebuilt in {self._failed_rebuilds} attempts: {self._gang.reason}"
            )
        if self._supervisor.done():
            raise RuntimeError("gang supervisor stopped unexpectedly")

    async def _supervise(self) -> None:
        """Probe the peers; rebuild a broken gang with exponential backoff."""
        since_probe = 0.0
        while self._gang.state is not GangState.STOPPED:
            await asyncio.sleep(0.25)
            since_probe += 0.25
            state = self._gang.state
            if state is GangState.READY and since_probe >= PROBE_INTERVAL_S:
                since_probe = 0.0
                await self._gang.probe()
            elif state is GangState.BROKEN:
                await self._rebuild_once()

    async def _rebuild_once(self) -> None:
        cause = self._gang.reason
        if self._failed_rebuilds:
            delay = min(MAX_BACKOFF_S, 2.0 ** (self._failed_rebuilds - 1))
            self._gang.reason = (
                f"rebuild attempt {self._failed_rebuilds} failed ({cause}); retrying in {delay:.0f}s"
            )
            await asyncio.sleep(delay)
        log.warning("rebuilding gang (attempt %d) after: %s", self._failed_rebuilds + 1, cause)
        self._gang.reason = f"rebuilding after: {cause}"
        try:
            await self._gang.rebuild()
            self._failed_rebuilds = 0
        except Exception as exc:
            self._failed_rebuilds += 1
            log.error("gang rebuild attempt %d failed: %s", self._failed_rebuilds, exc)

    def __del__(self) -> None:
        # Serve calls __del__ on graceful shutdown: leave the group, kill the peers.
        gang = getattr(self, "_gang", None)
        if gang is not None:
            gang.shutdown()
