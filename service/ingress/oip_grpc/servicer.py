"""`add_GRPCInferenceServiceServicer_to_server`: the servicer function Serve's `grpc_options`
name (service.cluster.front_door.GRPC_SERVICER_FUNCTIONS).

Serve calls it in each ingress replica (and in its Python proxy, HAProxy's backup) to learn
the service's methods: it keeps each method's request deserializer and routes the call to the
Ingress method of the same name (service.deployments.ingress). The methods are registered by
hand, not from a generated `_pb2_grpc.py`, so that a request reaches the Ingress as its raw
bytes: a message that does not parse is answered by our own INVALID_ARGUMENT `[malformed]`
(service.ingress.oip_grpc.messages), never by gRPC's opaque deserialization failure. The
methods not listed (Triton's statistics, repository, shared-memory, trace and log methods)
are not registered: gRPC answers them UNIMPLEMENTED.
"""
from __future__ import annotations

from typing import Any

import grpc

SERVICE = "inference.GRPCInferenceService"
UNARY_METHODS = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
                 "ModelInfer")
STREAM_METHODS = ("ModelStreamInfer",)  # bidirectional


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


def add_GRPCInferenceServiceServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 - gRPC's name
    """Register `servicer`'s methods (named like the RPCs) on `server`, requests as raw bytes."""
    handlers = {name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name), response_serializer=_serialize)
                for name in UNARY_METHODS}
    handlers.update({name: grpc.stream_stream_rpc_method_handler(getattr(servicer, name),
                                                                 response_serializer=_serialize)
                     for name in STREAM_METHODS})
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    register = getattr(server, "add_registered_method_handlers", None)
    if register is not None:  # grpcio >= 1.62, as its generated code does
        register(SERVICE, handlers)
