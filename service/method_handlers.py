"""`handler_like`: a gRPC method handler of another's kind (unary or streaming requests and responses) with a
behaviour and deserializer of one's own, for the server's interceptors (sluice.service.auth,
sluice.service.malformed_messages)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behaviour = Callable[[Any, grpc.aio.ServicerContext], Any]
Deserializer = Callable[[bytes], Any]


def handler_like(
    handler: grpc.RpcMethodHandler, behaviour: Behaviour, deserializer: Deserializer | None
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler`, with `behaviour` and `deserializer` (its serializer kept)."""
    serializers = {"request_deserializer": deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, **serializers)
    return grpc.unary_unary_rpc_method_handler(behaviour, **serializers)
