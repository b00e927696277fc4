"""Registering batchd's gRPC services, so that a message that does not parse is
answered INVALID_ARGUMENT and says so.

grpc's own answer to a request its deserializer refuses is UNKNOWN ("Unexpected
<class 'DecodeError'>") and an ERROR with a traceback in the log, for every such
call: any client could fill the log. Here each request deserializer is tolerant:
what does not parse comes out as an `Undecodable`, which a method taking one
request answers INVALID_ARGUMENT without running, and which ModelStreamInfer
answers as that request's error response while the stream goes on.

The handlers are made from the service's descriptor, as the generated
`add_*Servicer_to_server` makes them, with the servicer's methods by name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from batchd.server.errors import InvalidInput, set_status

_KINDS = {  # (client streaming, server streaming)
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class Undecodable:
    """A request message that did not parse; `error` says so."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidInput) -> None:
        self.error = error


def tolerant(message: type[Message]) -> Callable[[bytes], Any]:
    """`message.FromString`, returning an Undecodable where that raises."""
    parse, name = message.FromString, message.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return Undecodable(
                InvalidInput(f"a message of {len(data)} bytes that does not parse as {name}: {e}")
            )

    return deserialize


def _guarded(method: Callable[..., Any], server_streaming: bool) -> Callable[..., Any]:
    """`method`, not run for an Undecodable request: that is answered with its error."""
    if server_streaming:

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if type(request) is Undecodable:
                set_status(context, request.error)
                return
            async for response in method(request, context):
                yield response

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is Undecodable:
            set_status(context, request.error)
            return None
        return await method(request, context)

    return unary


def add_service(server: grpc.aio.Server, servicer: Any, service: ServiceDescriptor) -> None:
    """Serve `service` with `servicer`'s methods; each request is parsed by `tolerant`.
    A client-streaming method gets the Undecodable among its requests itself."""
    handlers = {}
    for m in service.methods:
        behavior: Callable[..., Awaitable[Any] | AsyncIterator[Any]] = getattr(servicer, m.name)
        if not m.client_streaming:
            behavior = _guarded(behavior, m.server_streaming)
        handlers[m.name] = _KINDS[m.client_streaming, m.server_streaming](
            behavior,
            request_deserializer=tolerant(GetMessageClass(m.input_type)),
            response_serializer=GetMessageClass(m.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)
