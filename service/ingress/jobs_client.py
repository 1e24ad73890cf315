"""The ingress's view of the JobManager deployment: bounded handle calls, mapped errors."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Request
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle

from service.errors import GangServeError, GangUnavailable

CALL_TIMEOUT_S = 30.0
log = logging.getLogger("gangserve.ingress")


class JobsUnavailable(GangUnavailable):
    code = "jobs_unavailable"


class JobsClient:
    """Calls JobManager methods; every wait is bounded, every failure a GangServeError."""

    def __init__(self, handle: DeploymentHandle | None, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self._handle = handle
        self._timeout_s = timeout_s

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._handle is None:
            raise JobsUnavailable("this application was deployed without a JobManager; training is unavailable")
        response = getattr(self._handle, method).remote(*args, **kwargs)
        try:
            return await asyncio.wait_for(_await(response), timeout=self._timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise JobsUnavailable(f"the job manager did not answer {method} within {self._timeout_s:.0f}s") from None
        except RayTaskError as exc:
            # Checked first: Ray's RayTaskError(InvalidInput) subclass does not carry the
            # instance's code; the original exception (`cause`) does.
            cause = getattr(exc, "cause", None)
            if isinstance(cause, GangServeError):
                raise cause from None
            log.error("job manager call %s failed: %s", method, exc)  # the traceback stays in the log
            raise JobsUnavailable(
                f"the job manager failed ({type(cause or exc).__name__}); see the service log"
            ) from None
        except GangServeError:
            raise
        except BackPressureError as exc:
            raise JobsUnavailable(f"the job manager is overloaded: {exc}", retry_after_s=1.0) from None
        except RayActorError as exc:
            raise JobsUnavailable(f"the job manager replica is gone ({type(exc).__name__}); Serve is restarting it") from None
        except (RayError, RayServeException) as exc:  # anything else on the way: unavailable, never a 500
            log.warning("job manager call %s failed: %s: %s", method, type(exc).__name__, exc)
            raise JobsUnavailable(f"the job manager could not be reached ({type(exc).__name__})") from None


def get_jobs(request: Request) -> JobsClient:
    return request.app.state.jobs


async def _await(response: Any) -> Any:
    return await response
