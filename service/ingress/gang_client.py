"""The ingress's view of the GangServer: handle calls with deadlines and error mapping."""
from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from service.errors import CollectiveTimeout, GangServeError, GangUnavailable


class GangClient:
    """Calls GangServer methods; every wait is bounded and every failure is a GangServeError."""

    def __init__(self, handle: DeploymentHandle, request_timeout_s: float) -> None:
        self._handle = handle
        self._timeout_s = request_timeout_s

    async def infer(self, x: np.ndarray) -> np.ndarray:
        return await self._call("infer", x, timeout_s=self._timeout_s)

    async def reload_weights(self, checkpoint: str, timeout_s: float = 300.0) -> dict[str, Any]:
        """Hot-swap the gang to a dense checkpoint; returns the new /gang description."""
        return await self._call("reload_weights", checkpoint, timeout_s=timeout_s)

    async def describe(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return await self._call("describe", timeout_s=timeout_s)

    async def _call(self, method: str, *args: Any, timeout_s: float) -> Any:
        response = getattr(self._handle, method).remote(*args)
        try:
            return await asyncio.wait_for(_await(response), timeout=timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise CollectiveTimeout(
                f"the gang did not answer {method} within {timeout_s:.1f}s", code="gang_timeout"
            ) from None
        except GangServeError:
            raise  # includes RayTaskError(GangServeError) from the replica
        except BackPressureError as exc:
            raise GangUnavailable(f"the gang is overloaded: {exc}", code="overloaded", retry_after_s=1.0) from None
        except RayActorError as exc:
            raise GangUnavailable(
                f"the gang server replica is gone ({type(exc).__name__}); Serve is restarting it",
                code="gang_restarting",
            ) from None
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, GangServeError):
                raise cause from None
            raise GangUnavailable(f"the gang server failed: {exc}", code="gang_error") from None


async def _await(response: Any) -> Any:
    return await response
