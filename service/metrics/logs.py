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

SERVE_LOGGER = "ray.serve"
SERVICE_LOGGER = "gangserve"


def route_logs_to_serve(level: int = logging.INFO) -> None:
    """Inside a Serve replica: the "gangserve" loggers use Serve's handlers (file, format,
    request context). Call from a deployment's __init__, after Serve configured its logger."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    if not serve_logger.handlers:  # not in a replica (or Serve changed how it logs): leave as is
        return
    ours = logging.getLogger(SERVICE_LOGGER)
    ours.handlers = list(serve_logger.handlers)
    ours.setLevel(level)
    ours.propagate = False
