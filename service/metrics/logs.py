"""The service's log lines go where Serve's go, in Serve's format, with the request id.

Serve configures only its own logger ("ray.serve") in each replica: its handler writes the
replica's log file (`logs/serve/replica_<app>_<deployment>_<id>.log`) as TEXT or, with
`logging_config={"encoding": "JSON"}` (the `log_encoding` builder argument), one JSON object
per line, and its filters add the Serve request context (request_id, route, application)
to every record logged while a request is handled. Without `route_logs_to_serve`, the
service's loggers ("gangserve.*") would fall through to Python's last-resort handler (the
worker's stderr file, WARNING and up, no request id).

The request id is Serve's: the client's `X-Request-Id` header, else one Serve assigns, and
Serve echoes it in the `X-Request-ID` response header (see service.ingress.observe). A
handle call made while handling a request carries it on to the GangServer.
"""
from __future__ import annotations

import logging

from service.contract.errors import ErrorCode, GangServeError

SERVE_LOGGER = "ray.serve"
SERVICE_LOGGER = "gangserve"
SERVE_CALL_FAILED = "Request failed."  # Serve's ERROR line, with traceback, for an exception a handle call raised


class AnsweredErrors(logging.Filter):
    """Serve logs every exception a handle call raises as ERROR "Request failed." with its
    traceback. Ours (GangServeError) are answers the caller turns into a status: a 4xx the
    request caused (an unknown job, a quota) or a 5xx the service states (a gang rebuilding,
    a deadline); a traceback for each buried a rebuild's one cause under hundreds of them. Such
    a record becomes one line, `call answered <status> <code>: <message>`, INFO for a 4xx,
    WARNING for a 5xx. An `internal` error (an unexpected failure: its traceback is what the
    docs promise) and any other exception keep Serve's line as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.msg != SERVE_CALL_FAILED or not isinstance(exc, GangServeError) or exc.code == ErrorCode.INTERNAL:
            return True
        record.msg, record.args = "call answered %d %s: %s", (exc.status, exc.code, exc.message)
        record.levelno = logging.INFO if exc.status < 500 else logging.WARNING
        record.levelname = logging.getLevelName(record.levelno)
        record.exc_info, record.exc_text = None, None
        return True


def route_logs_to_serve(level: int = logging.INFO) -> None:
    """Inside a Serve replica: the "gangserve" loggers use Serve's handlers (file, format,
    request context), and Serve's line for a handle call that raised one of our errors is that
    error's one line (AnsweredErrors). Call from a deployment's __init__, after Serve configured
    its logger."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    if not serve_logger.handlers:  # not in a replica (or Serve changed how it logs): leave as is
        return
    if not any(isinstance(f, AnsweredErrors) for f in serve_logger.filters):
        serve_logger.addFilter(AnsweredErrors())
    ours = logging.getLogger(SERVICE_LOGGER)
    ours.handlers = list(serve_logger.handlers)
    ours.setLevel(level)
    ours.propagate = False
