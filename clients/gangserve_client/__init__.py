"""gangserve-client: Python client and CLI (`gangserve --help`) for the gangserve HTTP API.

    from gangserve_client import GangServeClient
    with GangServeClient("http://127.0.0.1:8000") as c:
        y = c.infer(x)          # numpy in, numpy out (safetensors | npy | json on the wire)
        with c.session(prefill=x0) as s:
            y1 = s.append(row)  # a stateful session: causal over everything it was given

Modules: `client` (inference, sync and async), `sessions` (a session, sync and async),
`replies` (an answer's tensor and session state), `training` (jobs, datasets, weights), `codecs` (the wire formats, shared with the service),
`errors` (typed errors), `retries` (the retry policy), `tokens` (where tokens come from,
shared with the service), `cli` with `cli_training` (the `gangserve` command), `bench`
(`gangserve bench`, a load generator).
"""
from gangserve_client.client import AsyncGangServeClient, GangServeClient
from gangserve_client.errors import (
    AuthError,
    BadRequestError,
    ConflictError,
    GangServeError,
    GangServeHTTPError,
    GatewayTimeoutError,
    InvalidInputError,
    JobTimeoutError,
    NotAcceptableError,
    NotFoundError,
    OverLimitError,
    PayloadTooLargeError,
    QuotaExceededError,
    ServerError,
    ServiceUnreachableError,
    UnavailableError,
    UnsupportedMediaTypeError,
)
from gangserve_client.retries import RetryPolicy
from gangserve_client.sessions import AsyncSession, Session
from gangserve_client.training import TrainingClient

__version__ = "0.1.0"

__all__ = [
    "AsyncGangServeClient",
    "AsyncSession",
    "AuthError",
    "BadRequestError",
    "ConflictError",
    "GangServeClient",
    "GangServeError",
    "GangServeHTTPError",
    "GatewayTimeoutError",
    "InvalidInputError",
    "JobTimeoutError",
    "NotAcceptableError",
    "NotFoundError",
    "OverLimitError",
    "PayloadTooLargeError",
    "QuotaExceededError",
    "RetryPolicy",
    "ServerError",
    "Session",
    "ServiceUnreachableError",
    "TrainingClient",
    "UnavailableError",
    "UnsupportedMediaTypeError",
]
