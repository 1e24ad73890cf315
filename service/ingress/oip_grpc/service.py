"""The Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), in the Ingress.

`OipGrpc` answers the RPCs the Ingress deployment's methods of the same names receive
(service.deployments.ingress; Serve routes them there: service.cluster.front_door). Each one
keeps HTTP's rules by calling the code HTTP calls, never a copy:

- **readiness**: ServerLive is true while the replica serves (HTTP's /healthz, /livez);
  ServerReady and ModelReady are `readiness()` (/readyz's one answer): true when a gang can
  serve, false otherwise (with the reason as the status message);
- **metadata**: ModelMetadata is `/v2/models/attention`'s (service.ingress.oip.routes.metadata_of);
  ModelConfig says the same in Triton's model configuration (what tritonclient reads);
- **inference**: ModelInfer and each ModelStreamInfer request are decoded and checked as an
  HTTP OIP body is (service.ingress.oip_grpc.messages -> service.ingress.oip.codec), computed
  by service.ingress.oip.inference (the request policy: retries, the gang's choice, sessions
  for `sequence_id`/`sequence_start`/`sequence_end`, the `idempotency_key` parameter);
- **auth**: ModelInfer and ModelStreamInfer need the inference token when one is set, from the
  `authorization` metadata (`Bearer <token>`), by service.ingress.auth.check_inference, as
  HTTP's inference routes; the other calls need none, as HTTP's;
- **deadlines**: the call's gRPC deadline (answered a margin before it, as the client's own
  timer answers at it) and the `timeout` parameter (microseconds), the earlier; else
  request_timeout_s (service.ingress.oip.inference.deadline_of);
- **limits**: a message over max_body_bytes is refused by gRPC from its length
  (service.cluster.front_door.cap_grpc_messages) and by us (413 `body_too_large`,
  RESOURCE_EXHAUSTED); shapes, elements and dtypes as HTTP; big messages are decoded and big
  replies encoded in the ingress's DecodePool, as HTTP bodies are;
- **errors**: every GangServeError becomes its code's gRPC status, `[<code>] <message>` and
  trailing metadata `gangserve-code` (service.ingress.oip_grpc.status); on a stream, a
  request's error is its response's `error_message` (`[<code>] <message>`, Triton's way) and
  the stream goes on; an unexpected error is logged and answered INTERNAL `[internal]`;
- **metrics and logs**: every call (every request of a stream) is counted as an HTTP request
  is, with `protocol="grpc"` (service.ingress.observe.record_request); Serve logs an access line
  per call (`CALL <app> OK <ms>`, with its request id; OK even for our errors, whose status is
  set on the context rather than raised so that the trailing metadata goes out), and a failed
  call or stream request logs its status and message here.

A stream answers its requests one at a time, in the order they came: a sequence's appends
stay in order, and one response follows each request.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from service.cluster.front_door import grpc_deadline
from service.config.builder_args import AppConfig
from service.contract.errors import ErrorCode, GangServeError
from service.ingress import codecs
from service.ingress.auth import check_inference
from service.ingress.deps import DecodePool, FleetReader, Gang
from service.ingress.observe import Publisher, record_request
from service.ingress.oip.inference import answer, deadline_of
from service.ingress.oip.routes import metadata_of
from service.ingress.oip.schemas import MODEL_NAME, MODEL_VERSION, SERVER_NAME, SERVER_VERSION
from service.ingress.oip_grpc import gangserve_inference_pb2 as pb
from service.ingress.oip_grpc import messages
from service.ingress.oip_grpc.servicer import SERVICE
from service.ingress.oip_grpc.status import Failure
from service.ingress.readiness import readiness
from service.metrics.process import MetricSet, process_metrics

log = logging.getLogger("gangserve.ingress")

BODY_FORMAT = "protobuf"  # the metrics' `format` label of a gRPC message
_DATA_TYPES = {"FP32": pb.TYPE_FP32, "FP16": pb.TYPE_FP16, "BF16": pb.TYPE_BF16, "FP64": pb.TYPE_FP64}


@dataclass(frozen=True)
class Tokens:
    """The tokens the ingress checks (service.ingress.auth): the API token, the optional inference token."""

    api: str
    infer: str | None


@dataclass
class _Call:
    """One call (or one request of a stream) on its way: what its metrics line says."""

    method: str
    started: float
    read: int
    status: int = 500  # the HTTP status of its answer (200, or its error's)


class OipGrpc:
    """The RPCs, each `(raw request bytes, Serve's gRPC context) -> response message`."""

    def __init__(self, config: AppConfig, gang: Gang, fleet: FleetReader, pool: DecodePool, tokens: Tokens,
                 publisher: Publisher | None = None, metrics: MetricSet | None = None) -> None:
        self._cfg = config
        self._gang = gang
        self._fleet = fleet
        self._pool = pool
        self._tokens = tokens
        self._publisher = publisher  # reports this replica's metrics to the Controller (as HTTP's middleware starts it)
        self._metrics = metrics or process_metrics()
        self._limits = codecs.Limits.of(config)

    # ------------------------------------------------------------ health and metadata

    async def server_live(self, raw: bytes, context: Any) -> Any:
        return await self._unary("ServerLive", raw, context, pb.ServerLiveResponse, self._live)

    async def server_ready(self, raw: bytes, context: Any) -> Any:
        return await self._unary("ServerReady", raw, context, pb.ServerReadyResponse, self._server_ready)

    async def model_ready(self, raw: bytes, context: Any) -> Any:
        return await self._unary("ModelReady", raw, context, pb.ModelReadyResponse, self._model_ready)

    async def server_metadata(self, raw: bytes, context: Any) -> Any:
        return await self._unary("ServerMetadata", raw, context, pb.ServerMetadataResponse, self._server_metadata)

    async def model_metadata(self, raw: bytes, context: Any) -> Any:
        return await self._unary("ModelMetadata", raw, context, pb.ModelMetadataResponse, self._model_metadata)

    async def model_config(self, raw: bytes, context: Any) -> Any:
        return await self._unary("ModelConfig", raw, context, pb.ModelConfigResponse, self._model_config)

    async def _live(self, raw: bytes, context: Any) -> Any:
        messages.parse(raw, pb.ServerLiveRequest, self._cfg.serving.max_body_bytes)
        return pb.ServerLiveResponse(live=True)

    async def _server_ready(self, raw: bytes, context: Any) -> Any:
        messages.parse(raw, pb.ServerReadyRequest, self._cfg.serving.max_body_bytes)
        return pb.ServerReadyResponse(ready=await self._ready(context))

    async def _model_ready(self, raw: bytes, context: Any) -> Any:
        msg = messages.parse(raw, pb.ModelReadyRequest, self._cfg.serving.max_body_bytes)
        if msg.name != MODEL_NAME or msg.version not in ("", MODEL_VERSION):
            return pb.ModelReadyResponse(ready=False)  # as HTTP's is_model_ready of another model: not ready
        return pb.ModelReadyResponse(ready=await self._ready(context))

    async def _ready(self, context: Any) -> bool:
        """/readyz's answer; when not ready, the reason is the status message (the call succeeds)."""
        try:
            await readiness(self._gang, self._fleet)
        except GangServeError as exc:
            context.set_details(Failure.of(exc).details)
            return False
        return True

    async def _server_metadata(self, raw: bytes, context: Any) -> Any:
        messages.parse(raw, pb.ServerMetadataRequest, self._cfg.serving.max_body_bytes)
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=[])

    async def _model_metadata(self, raw: bytes, context: Any) -> Any:
        msg = messages.parse(raw, pb.ModelMetadataRequest, self._cfg.serving.max_body_bytes)
        messages.check_model(msg.name, msg.version)
        meta = metadata_of(self._cfg)
        tensors = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta.name, versions=meta.versions, platform=meta.platform,
            inputs=[tensors(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.inputs],
            outputs=[tensors(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.outputs],
        )

    async def _model_config(self, raw: bytes, context: Any) -> Any:
        msg = messages.parse(raw, pb.ModelConfigRequest, self._cfg.serving.max_body_bytes)
        messages.check_model(msg.name, msg.version)
        meta = metadata_of(self._cfg)
        config = pb.ModelConfig(
            name=meta.name, platform=meta.platform, backend="gangserve", max_batch_size=0,
            input=[pb.ModelInput(name=t.name, data_type=_DATA_TYPES[t.datatype], dims=t.shape) for t in meta.inputs],
            output=[pb.ModelOutput(name=t.name, data_type=_DATA_TYPES[t.datatype], dims=t.shape) for t in meta.outputs],
        )
        return pb.ModelConfigResponse(config=config)

    # ------------------------------------------------------------ inference

    async def model_infer(self, raw: bytes, context: Any) -> Any:
        return await self._unary("ModelInfer", raw, context, pb.ModelInferResponse, self._infer_call)

    async def _infer_call(self, raw: bytes, context: Any) -> Any:
        self._check_token(context)
        return await self._infer(raw, grpc_deadline(context))

    async def model_stream_infer(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
        """One ModelStreamInferResponse per request, in order; a request's error is its
        response's error_message. A refused token ends the stream at once (UNAUTHENTICATED)."""
        method = "ModelStreamInfer"
        if self._publisher is not None:
            self._publisher.ensure_started()
        try:
            self._check_token(context)
        except GangServeError as exc:
            refused = _Call(method, time.perf_counter(), 0)
            self._fail(context, Failure.of(exc), refused)
            self._record(refused)
            return
        stream_deadline = grpc_deadline(context)
        async for raw in requests:
            call = _Call(method, time.perf_counter(), len(raw))
            try:
                response = pb.ModelStreamInferResponse(infer_response=await self._infer(raw, stream_deadline))
                call.status = 200
            except GangServeError as exc:
                failure = Failure.of(exc)
                call.status = failure.http_status
                _log_failure(method, failure)
                response = pb.ModelStreamInferResponse(error_message=failure.details,
                                                       infer_response=messages.failed_response(
                                                           messages.request_id_of(raw)))
            except Exception:  # noqa: BLE001 - answered, logged; the stream goes on
                log.exception("unexpected error in a gRPC ModelStreamInfer request")
                failure = Failure.of(GangServeError("internal error (logged by the service)"))
                response = pb.ModelStreamInferResponse(error_message=failure.details)
            finally:
                self._record(call)
            yield response

    async def _infer(self, raw: bytes, stated_deadline: float | None) -> Any:
        started = time.monotonic()  # the deadline counts from here (service.contract.deadlines)
        serving = self._cfg.serving
        if len(raw) <= self._cfg.tunables.ingress.inline_decode_bytes:
            decoded = messages.decode_infer(raw, self._limits, serving.max_body_bytes)
        else:
            decoded = await self._pool.run(messages.decode_infer, raw, self._limits, serving.max_body_bytes)
        stated_s = None if stated_deadline is None else stated_deadline - started
        deadline = deadline_of(decoded.request, started, self._cfg, stated_s,
                               stated_by_a_timer_in_front=stated_s is not None)
        result = await answer(decoded.request, decoded.inputs, self._gang, deadline)
        if result.output.size > self._cfg.tunables.ingress.inline_encode_values:
            return await self._pool.run_unbounded(messages.infer_response, decoded.request, result)
        return messages.infer_response(decoded.request, result)

    def _check_token(self, context: Any) -> None:
        error = check_inference(_metadata(context, "authorization"), self._tokens.infer, self._tokens.api)
        if error is not None:
            raise error

    # ------------------------------------------------------------ one unary call

    async def _unary(self, method: str, raw: bytes, context: Any, empty: Callable[[], Any],
                     handler: Callable[[bytes, Any], Awaitable[Any]]) -> Any:
        """handler's response; a GangServeError (or an unexpected error, logged) sets the call's
        status, message and trailing metadata and answers an empty `empty` message."""
        call = _Call(method, time.perf_counter(), len(raw))
        if self._publisher is not None:
            self._publisher.ensure_started()
        try:
            response = await handler(raw, context)
            call.status = 200
            return response
        except GangServeError as exc:
            self._fail(context, Failure.of(exc), call)
            return empty()
        except Exception:  # noqa: BLE001 - answered INTERNAL; the traceback stays in the log
            log.exception("unexpected error in gRPC %s", method)
            self._fail(context, Failure.of(GangServeError("internal error (logged by the service)",
                                                          code=ErrorCode.INTERNAL)), call)
            return empty()
        finally:
            self._record(call)

    @staticmethod
    def _fail(context: Any, failure: Failure, call: _Call) -> None:
        context.set_code(failure.status)
        context.set_details(failure.details)
        context.set_trailing_metadata(list(failure.trailing_metadata))
        call.status = failure.http_status
        _log_failure(call.method, failure)

    def _record(self, call: _Call) -> None:
        record_request(self._metrics, "grpc", f"/{SERVICE}/{call.method}", BODY_FORMAT, call.status,
                       time.perf_counter() - call.started, call.read)


def _log_failure(method: str, failure: Failure) -> None:
    """One line per failed call, in the replica's log with Serve's request id: Serve's own access
    line says OK for it (the call returns normally, its status set on the context, so that the
    trailing metadata goes out)."""
    log.info("gRPC %s answered %s %s", method, failure.status.name, failure.details[:200])


def _metadata(context: Any, key: str) -> str | None:
    """The call's metadata value for `key` (lower case, as gRPC sends it), None when absent."""
    for name, value in context.invocation_metadata():
        if name == key:
            return value if isinstance(value, str) else value.decode("latin-1")
    return None

