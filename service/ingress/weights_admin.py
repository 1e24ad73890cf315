"""Weights administration (POST /weights): the gang's hot swaps, off the request path.

A swap is one bounded call to a gang server (ingress.swap_timeout_s); it changes the
weights version every later request is served with, so the status view looks again.
"""
from __future__ import annotations

from service.contract.gang_status import GangStatus
from service.ingress.gang_calls import GangServerCalls
from service.ingress.status_view import GangStatusView


class WeightsAdmin:
    """Swaps the gang's weights through a GangServer replica."""

    def __init__(self, calls: GangServerCalls, status: GangStatusView, swap_timeout_s: float) -> None:
        self._calls = calls
        self._status = status
        self._swap_timeout_s = swap_timeout_s

    async def reload_weights(self, checkpoint: str | None, job_id: str | None = None,
                             eval_loss: float | None = None) -> GangStatus:
        """Hot-swap the gang to a dense checkpoint (None: back to the app's configured
        weights), recorded as the app's next weights version (with the job's final
        `eval_loss`, if any); returns the gang's new report."""
        self._status.look_again()  # the version changes
        return await self._calls.call("reload_weights", checkpoint, job_id, eval_loss, timeout_s=self._swap_timeout_s)

    async def rollback_weights(self, version: int) -> GangStatus:
        """Serve recorded weights `version` again (GangServer.rollback_weights), recorded as
        the app's next version; returns the gang's new report."""
        self._status.look_again()
        return await self._calls.call("rollback_weights", version, timeout_s=self._swap_timeout_s)
