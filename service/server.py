"""GangServer: the Serve deployment that owns the gang. It never parses HTTP.

One replica = one gang. Serve reserves the replica's placement group
(`placement_group_bundles`, one bundle per rank) before the replica starts; the replica
itself is rank 0 in bundle 0 and places ranks 1..N-1 in the other bundles.
"""
from __future__ import annotations

import logging

import numpy as np
from ray import serve
from ray.util import get_current_placement_group

from service.config import AppConfig, GangConfig, ModelConfig
from service.errors import Conflict
from service.gang.gang import Gang, GangState
from service.parallel.weights import check_checkpoint

log = logging.getLogger("gangserve.server")


@serve.deployment(name="GangServer", health_check_period_s=5, health_check_timeout_s=30)
class GangServer:
    """Owns one Gang; answers inference and status calls from the ingress."""

    async def __init__(self, config: dict) -> None:
        cfg = AppConfig.model_validate(config)
        self._gang = Gang(cfg.part(ModelConfig), cfg.part(GangConfig), get_current_placement_group())
        try:
            await self._gang.start()
        except Exception:
            self._gang.shutdown()
            raise

    async def infer(self, x: np.ndarray) -> np.ndarray:
        """x: [batch, seq, E] float32 (validated by the ingress) -> [batch, seq, E] float32."""
        return await self._gang.infer(x)

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
        return self._gang.describe()

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica (and gang)."""
        if self._gang.state is GangState.BROKEN:
            raise RuntimeError(f"gang broken: {self._gang.reason}")

    def __del__(self) -> None:
        # Serve calls __del__ on graceful shutdown: leave the group, kill the peers.
        gang = getattr(self, "_gang", None)
        if gang is not None:
            gang.shutdown()
