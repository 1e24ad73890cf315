"""The FastAPI application: routers, state, auth and error mapping to {"error", "code"}.

Every error reply is `{"error", "code"}`, its message bounded (service.contract.errors.bounded);
an unexpected exception is logged with its traceback and answered 500 without its text.
`AuthMiddleware` (service.ingress.auth) checks tokens before any route reads a body.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.ingress.auth import AuthMiddleware, load_api_token, load_infer_token
from service.config.builder_args import AppConfig
from service.contract.errors import ErrorCode, GangServeError, bounded, describe_validation_errors
from service.ingress.deps import DecodePool, Gang, Weights
from service.ingress.fleet_client import FleetClient
from service.ingress.jobs_client import JobsClient
from service.ingress.routes import health, infer
from service.ingress.oip import routes as oip
from service.ingress.routes import datasets, train, weights
from service.ingress.routes import retention
from service.ingress.routes import metrics
from service.ingress.routes import sessions
from service.ingress.observe import RequestMetrics, make_publisher
from service.ingress.routes.ui import mount_ui

log = logging.getLogger("gangserve.ingress")


def error_response(status: int, message: str, code: ErrorCode | str, retry_after_s: float | None = None) -> JSONResponse:
    """`{"error": message, "code": code}` with `status`, and Retry-After (whole seconds, at least 1) when given."""
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s else None
    return JSONResponse({"error": bounded(message), "code": code}, status_code=status, headers=headers)


def create_api(config: AppConfig, gang: Gang, jobs: JobsClient | None = None,
               fleet: FleetClient | None = None, weights_admin: Weights | None = None) -> FastAPI:
    """The HTTP app: the routes over `gang` (the request path), `weights_admin` (POST /weights; None:
    an app whose tests never swap), the JobManager and the Controller."""
    # FastAPIOffline: /docs and /redoc served from the package's static files (no CDN).
    app = FastAPIOffline(
        title="gangserve",
        version="0.1.0",
        description="Tensor-parallel multi-head attention served by a persistent process-group gang.",
    )
    app.state.config = config
    app.state.gang = gang
    app.state.weights = weights_admin
    app.state.jobs = jobs or JobsClient(None)
    app.state.api_token, token_source = load_api_token()
    app.state.infer_token = load_infer_token()
    app.state.decode_pool = DecodePool(config.serving.decode_threads, config.serving.max_pending_decodes)
    log.info("/train*, /datasets*, /weights* need 'Authorization: Bearer <token>'; token from %s", token_source)
    if app.state.infer_token:
        log.info("inference routes need the inference token ($GANGSERVE_INFER_TOKEN)")
    # Before routing: a request without the right token is answered here, before
    # dependencies or body parsing (only the metrics middleware is outside it).
    app.add_middleware(AuthMiddleware, api_token=app.state.api_token, infer_token=app.state.infer_token)
    # Outside auth: refused requests are counted too (service.ingress.observe).
    app.state.fleet = fleet or FleetClient(None, config)  # the Controller: fleet view, weights record
    app.state.metrics_publisher = make_publisher(app.state.fleet)
    app.add_middleware(RequestMetrics, publisher=app.state.metrics_publisher)
    app.include_router(health.router)
    app.include_router(infer.router)
    app.include_router(sessions.router)
    app.include_router(oip.router)
    app.include_router(train.router)
    app.include_router(datasets.router)
    app.include_router(weights.router)
    app.include_router(retention.router)
    app.include_router(metrics.router)
    mount_ui(app)  # /ui/: the status page, static files only (no token, no data)
    install_error_handlers(app)
    return app


# The framework's own errors (an unknown route, a method the route does not take), by status.
_FRAMEWORK_CODES = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}


def install_error_handlers(app: FastAPI) -> None:
    """Every error as `{"error", "code"}` with its status (and Retry-After): the ingress's
    routes answer alike."""

    @app.exception_handler(GangServeError)
    async def _gangserve_error(_: Request, exc: GangServeError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid request: " + describe_validation_errors(exc.errors(), "request"),
                              ErrorCode.INVALID_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _FRAMEWORK_CODES.get(exc.status_code, ErrorCode.HTTP_ERROR)
        return error_response(exc.status_code, str(exc.detail)[:200], code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")  # the traceback stays in the log; the reply says nothing internal
        return error_response(500, "internal error (logged by the service)", ErrorCode.INTERNAL)
