"""The cluster secret on gRPC: every call without it is refused before it reaches the servicer."""

from __future__ import annotations

import hmac
from typing import Any, Callable

import grpc

from .wire import SECRET_KEY


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every call whose `x-mtpipe-secret` metadata is not the cluster secret (UNAUTHENTICATED)."""

    def __init__(self, secret: str):
        self._secret = secret.encode()

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        given = dict(details.invocation_metadata or ()).get(SECRET_KEY, "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._secret):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        return _deny_handler(handler)


def _deny_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or wrong cluster secret"

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # unreachable: an async generator, as streaming handlers are

    make = {
        (False, False): (grpc.unary_unary_rpc_method_handler, deny),
        (False, True): (grpc.unary_stream_rpc_method_handler, deny_stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, deny),
        (True, True): (grpc.stream_stream_rpc_method_handler, deny_stream),
    }
    factory, behavior = make[(handler.request_streaming, handler.response_streaming)]
    return factory(behavior, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)
