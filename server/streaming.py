"""ModelStreamInfer: many requests on one bidirectional stream, answered as they
finish, in Triton's decoupled way.

Each request of the stream runs on its own (at most STREAM_WINDOW at once); a
one-shot model's answer is one response, a step-wise model's every output is
one, all carrying the request's `id` and the response parameter
`triton_final_response` (true on the request's last response). A request that
sets `triton_enable_empty_final_response` gets its outputs with final=false
and an empty final response after them; one whose sequence ends with a step
that yields nothing gets that empty final response too, so the end is always
marked. A failure is a response with `error_message` (and its gRPC status name
in the `error_code` parameter), and the stream goes on: so is a message that
does not parse (handlers.Undecodable; its response has no id), and a request
that fails for a defect of ours ("internal error", logged). Should the request
stream itself fail, the responses end after those of the requests in flight,
and the call ends with its error.
Responses wait in a bounded queue: a client that does not read holds up its
sequences, whose own buffers then fill (request.StepStream) and fail them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from batchd.protos import inference_pb2 as pb
from batchd.server.codec import encode_response
from batchd.server.errors import BatchdError
from batchd.server.handlers import Undecodable
from batchd.server.request import Request, Tensor

STREAM_WINDOW = 256  # requests of one stream in flight at once
QUEUED_RESPONSES = 256  # responses of one stream waiting for the client to take them
FINAL, EMPTY_FINAL = "triton_final_response", "triton_enable_empty_final_response"
log = logging.getLogger("batchd.server")


class Answers(Protocol):
    """What a stream needs from the servicer."""

    def is_stepwise(self, msg: pb.ModelInferRequest) -> bool: ...

    async def infer(
        self, msg: pb.ModelInferRequest, time_remaining: float | None, carrier: Any = None
    ) -> pb.ModelInferResponse: ...

    def sequence(
        self, msg: pb.ModelInferRequest, time_remaining: float | None, carrier: Any = None
    ) -> AsyncIterator[tuple[Request, list[Tensor], bool]]: ...

    def max_response_bytes(self) -> int: ...


def _final(response: pb.ModelInferResponse, final: bool) -> pb.ModelStreamInferResponse:
    response.parameters[FINAL].bool_param = final
    return pb.ModelStreamInferResponse(infer_response=response)


def _empty_final(msg: pb.ModelInferRequest, request: Request | None) -> pb.ModelStreamInferResponse:
    model = request.model if request is not None else None
    response = pb.ModelInferResponse(
        model_name=model.name if model else msg.model_name,
        model_version=model.version if model else "",
        id=msg.id,
    )
    return _final(response, True)


async def _steps(service: Answers, msg: pb.ModelInferRequest, put: Any, carrier: Any,
                 time_remaining: float | None) -> None:  # fmt: skip
    """A step-wise request's responses, one per output."""
    empty_final = msg.parameters[EMPTY_FINAL].bool_param if EMPTY_FINAL in msg.parameters else False
    request, last = None, False
    async for request, outputs, final in service.sequence(msg, time_remaining, carrier):
        last = final and not empty_final
        response = encode_response(request, outputs, service.max_response_bytes())
        await put(_final(response, last))
    if not last:
        await put(_empty_final(msg, request))


async def respond(
    service: Answers,
    requests: AsyncIterator[pb.ModelInferRequest],
    carrier: Any = None,
    time_remaining: Callable[[], float | None] = lambda: None,
) -> AsyncIterator[pb.ModelStreamInferResponse]:
    """The stream's responses; `carrier`: its metadata, where a traceparent is read from
    (every request of the stream is a child of it); `time_remaining`: the call's, when
    each request arrives (the call's deadline is each request's: one that the deadline
    ends counts as `deadline`, not `cancelled`)."""
    responses: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue(QUEUED_RESPONSES)
    window = asyncio.Semaphore(STREAM_WINDOW)

    async def one(msg: pb.ModelInferRequest | Undecodable) -> None:
        try:
            try:
                if isinstance(msg, Undecodable):
                    raise msg.error
                if service.is_stepwise(msg):
                    await _steps(service, msg, responses.put, carrier, time_remaining())
                else:
                    response = await service.infer(msg, time_remaining(), carrier)
                    await responses.put(_final(response, True))
            except BatchdError as e:
                await responses.put(_error(msg, e))
            except Exception:  # a defect: this request fails, the stream's others go on
                log.exception("a ModelStreamInfer request failed")
                await responses.put(_error(msg, BatchdError("internal error")))
        finally:
            window.release()

    ended: list[BaseException] = []  # what ended the request stream, if not its end

    async def read() -> None:
        async with asyncio.TaskGroup() as tg:
            try:
                async for msg in requests:
                    await window.acquire()
                    tg.create_task(one(msg))
            except Exception as e:  # the requests' stream failed: those in flight are
                ended.append(e)  # still answered, then the call ends with its error
        await responses.put(None)

    reader = asyncio.create_task(read())
    try:
        while (out := await responses.get()) is not None:
            yield out
        await reader
        if ended:
            raise ended[0]
    finally:
        reader.cancel()


def _error(msg: pb.ModelInferRequest | Undecodable, e: BatchdError) -> pb.ModelStreamInferResponse:
    """A failed request's response: its error, and its model and id where it parsed."""
    error = pb.ModelInferResponse()
    if not isinstance(msg, Undecodable):
        error.model_name, error.id = msg.model_name[:200], msg.id
    error.parameters["error_code"].string_param = e.code.name  # for typed errors
    return pb.ModelStreamInferResponse(error_message=e.message, infer_response=error)


def join_steps(steps: Sequence[list[Tensor]]) -> list[Tensor]:
    """Every step's outputs joined along their first dim: a unary answer."""
    if not steps:
        return []
    joined = []
    for pieces in zip(*steps, strict=True):
        first = pieces[0]
        rows = sum(p.shape[0] for p in pieces)
        data = b"".join(p.data for p in pieces)
        joined.append(Tensor(first.name, first.datatype, (rows, *first.shape[1:]), data))
    return joined
