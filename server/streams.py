"""`--max-concurrent-streams`: at most N RPCs open at once per client connection.

HTTP/2's own SETTINGS_MAX_CONCURRENT_STREAMS makes the server reset the
streams over the limit (REFUSED_STREAM), which grpc clients report as
UNAVAILABLE "Stream removed": unclear, and retried blindly. This interceptor
keeps the count per connection (the peer address) and answers one RPC too
many with RESOURCE_EXHAUSTED, naming the limit, before the handler runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class StreamLimit(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._open: Counter[str] = Counter()  # RPCs open, by connection

    async def _enter(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        peer: str = context.peer()
        if self._open[peer] >= self._limit:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this connection has {self._open[peer]} RPCs open, the limit per connection "
                f"(--max-concurrent-streams {self._limit}); wait for one to finish or open "
                "another connection",
            )
        self._open[peer] += 1
        return peer

    def _leave(self, peer: str) -> None:
        self._open[peer] -= 1
        if not self._open[peer]:
            del self._open[peer]

    def _unary_response(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def counted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            peer = await self._enter(context)
            try:
                return await fn(request, context)
            finally:
                self._leave(peer)

        return counted

    def _streamed_response(
        self, fn: Callable[..., AsyncIterator[Any]]
    ) -> Callable[..., AsyncIterator[Any]]:
        async def counted(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            peer = await self._enter(context)
            try:
                async for response in fn(request, context):
                    yield response
            finally:
                self._leave(peer)

        return counted

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        h = await continuation(details)
        if h is None:
            return None
        codecs = {
            "request_deserializer": h.request_deserializer,
            "response_serializer": h.response_serializer,
        }
        if h.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._unary_response(h.unary_unary), **codecs
            )
        if h.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._unary_response(h.stream_unary), **codecs
            )
        if h.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._streamed_response(h.unary_stream), **codecs
            )
        return grpc.stream_stream_rpc_method_handler(
            self._streamed_response(h.stream_stream), **codecs
        )
