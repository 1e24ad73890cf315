"""The ingress's view of the JobManager deployment: bounded handle calls, mapped errors."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from ray.serve.handle import DeploymentHandle

from service.contract.errors import ErrorCode, GangServeError, GangUnavailable
from service.ingress.handle_errors import bounded_call
from service.config.tunables import IngressTunables



class JobsUnavailable(GangUnavailable):
    code = ErrorCode.JOBS_UNAVAILABLE


class JobsClient:
    """Calls JobManager methods; every wait is bounded, every failure a GangServeError."""

    def __init__(self, handle: DeploymentHandle | None, timeout_s: float = IngressTunables().jobs_call_timeout_s) -> None:
        """`timeout_s`: ingress.jobs_call_timeout_s (the state stores' waits stay below it)."""
        self._handle = handle
        self._timeout_s = timeout_s

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._handle is None:
            raise JobsUnavailable("this application was deployed without a JobManager; training is unavailable")
        return await bounded_call(self._handle, method, *args, what="job manager", timeout_s=self._timeout_s,
                                  unavailable=_jobs_unavailable, **kwargs)


def _jobs_unavailable(message: str, _code: ErrorCode, retry_after_s: float | None) -> GangServeError:
    return JobsUnavailable(message, retry_after_s=retry_after_s)  # one code for every jobs outage


async def get_jobs(request: Request) -> JobsClient:
    return request.app.state.jobs

