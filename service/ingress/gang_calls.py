"""Every call from this ingress replica to a GangServer replica: bounded, its deadline carried
as `timeout_s=` (the seconds left), Ray's errors mapped (service.ingress.handle_errors)."""
from __future__ import annotations

import time
from typing import Any, Callable

from ray.exceptions import RayError, RayTaskError
from ray.serve.handle import DeploymentHandle

from service.config.builder_args import AppConfig
from service.contract.deadlines import bounded, seconds_left
from service.contract.errors import CollectiveTimeout, DeadlineExceeded, ErrorCode, GangServeError
from service.ingress.handle_errors import awaited, map_handle_error
from service.transport import shm


class GangServerCalls:
    """Calls to the GangServer deployment (Serve's router picks the replica; a `session_id`
    keyword steers it): bounded, failures mapped to GangServeErrors."""

    def __init__(self, handle: DeploymentHandle, config: AppConfig) -> None:
        self._handle = handle
        self._request_timeout_s = config.serving.request_timeout_s
        self.replica_lost_at = 0.0  # time.monotonic() of the last failure that was not the gang's own answer

    async def call(self, method: str, *args: Any, timeout_s: float | None = None, deadline: float | None = None,
                   **kwargs: Any) -> Any:
        """GangServer.<method>(*args, **kwargs) by `deadline` (monotonic; carried to the method
        as `timeout_s=`, the seconds left; 504 deadline_exceeded after), or else within
        `timeout_s` (default `request_timeout_s`; 504 gang_timeout after)."""
        if deadline is None:
            limit_s = self._request_timeout_s if timeout_s is None else timeout_s
            response = getattr(self._handle, method).remote(*args, **kwargs)
            until = time.monotonic() + limit_s
            timed_out: Callable[[], BaseException] = lambda: CollectiveTimeout(
                f"the gang did not answer {method} within {limit_s:.1f}s", code=ErrorCode.GANG_TIMEOUT)
        else:
            response = getattr(self._handle, method).remote(*args, timeout_s=seconds_left(deadline), **kwargs)
            until = deadline
            timed_out = lambda: DeadlineExceeded(f"the request's deadline passed while the gang computed {method}")
        try:
            return await bounded(awaited(response), until=until, timed_out=timed_out, on_cancel=response.cancel)
        except Exception as exc:
            if isinstance(exc, GangServeError) and not isinstance(exc, RayTaskError):
                raise  # ours: the bound
            error = map_handle_error(exc, what="gang server", method=method,
                                     passthrough=(shm.SharedMemoryUnavailable,))
            if error is None:
                raise
            if isinstance(exc, RayError) and not isinstance(exc, RayTaskError):
                self.replica_lost_at = time.monotonic()  # the replica may be gone: look at the gang again
            raise error from None
