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
that fails for a defect of ours ("internal error", logged). As Triton's, a failed
request's response carries its id, model name and version and
`triton_final_response = true` (whatever `triton_enable_empty_final_response`
says): it is the request's last. Should the request stream itself fail, the
responses end after those of the requests in flight, and the call ends with its
error; but a message over --max-message-bytes ends the call in gRPC itself, and
the requests in flight get no more responses.

A client that does not read cannot grow the server's memory, and one that reads
as fast as it can is never cut: the bytes of outputs it has not taken, in its
sequences' buffers and in the responses waiting to go out, count against one
budget per stream (flow.StreamBudget, twice --max-message-bytes). A step-wise
request waits to be read while the stream's sequences' windows of credit hold
half of it, and any request while more than half of it waits for the client
(gRPC's flow control then holds the client's sends); a one-shot request while
the answers of those read before it would pass that half, with its own (what
the model's signature says an answer holds, or where it does not, the stream's
largest answer yet: answer_bytes); a sequence's worker sends
no more than its window ahead of what the client took (flow.StepStream). A step
that would not fit in what a response carries ends its sequence with
RESOURCE_EXHAUSTED. Other streams are not concerned.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc

from batchd.protos import inference_pb2 as pb
from batchd.protos.model_config import ModelConfig
from batchd.server.codec import echoable, encode_response, fixed_output_bytes
from batchd.server.errors import BatchdError, InvalidInput, Unavailable, clip
from batchd.server.flow import StepStream, stream_budget
from batchd.server.handlers import Undecodable
from batchd.server.request import Request, Tensor

STREAM_WINDOW = 256  # requests of one stream in flight at once
QUEUED_RESPONSES = 256  # responses of one stream waiting for the client to take them
FINAL, EMPTY_FINAL = "triton_final_response", "triton_enable_empty_final_response"
log = logging.getLogger("batchd.server")


class Answers(Protocol):
    """What a stream needs from the servicer."""

    def served(self, msg: pb.ModelInferRequest) -> ModelConfig | None: ...

    async def infer(
        self, msg: pb.ModelInferRequest, time_remaining: float | None, carrier: Any = None
    ) -> pb.ModelInferResponse: ...

    def sequence(
        self, msg: pb.ModelInferRequest, time_remaining: float | None, carrier: Any = None,
        stream: StepStream | None = None,
    ) -> AsyncGenerator[tuple[Request, list[Tensor], bool]]: ...  # fmt: skip

    def max_response_bytes(self) -> int: ...


def _final(response: pb.ModelInferResponse, final: bool) -> pb.ModelStreamInferResponse:
    response.parameters[FINAL].bool_param = final
    return pb.ModelStreamInferResponse(infer_response=response)


def _empty_final(msg: pb.ModelInferRequest, model: ModelConfig) -> pb.ModelStreamInferResponse:
    response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=msg.id)
    return _final(response, True)


Put = Callable[[pb.ModelStreamInferResponse, StepStream | None], Awaitable[None]]


async def _steps(service: Answers, msg: pb.ModelInferRequest, cfg: ModelConfig, put: Put,
                 carrier: Any, time_remaining: float | None,
                 stream: StepStream) -> None:  # fmt: skip
    """A step-wise request's responses, one per output; `cfg`: its model, as it came;
    `stream`: where its outputs go (handed on: taken once gRPC took them)."""
    empty_final = msg.parameters[EMPTY_FINAL].bool_param if EMPTY_FINAL in msg.parameters else False
    request, last = None, False
    sequence = service.sequence(msg, time_remaining, carrier, stream)
    async with contextlib.aclosing(sequence):
        async for request, outputs, final in sequence:
            last = final and not empty_final
            try:
                response = encode_response(request, outputs, service.max_response_bytes())
            except BaseException as e:
                stream.taken(stream.last_bytes)
                if isinstance(e, BatchdError):  # (its statistics say what it was: closed, it
                    await sequence.athrow(e)  # was counted `cancelled`, late review 58d)
                raise
            await put(_final(response, last), stream)
    if not last:
        await put(_empty_final(msg, request.model if request is not None else cfg), None)


Queued = tuple[pb.ModelStreamInferResponse, Callable[[], None]]  # and what taking it settles


def _size(response: pb.ModelStreamInferResponse) -> int:
    return sum(len(raw) for raw in response.infer_response.raw_output_contents)


async def respond(
    service: Answers,
    requests: AsyncIterator[pb.ModelInferRequest],
    carrier: Any = None,
    time_remaining: Callable[[], float | None] = lambda: None,
) -> AsyncGenerator[pb.ModelStreamInferResponse]:
    """The stream's responses; `carrier`: its metadata, where a traceparent is read from
    (every request of the stream is a child of it); `time_remaining`: the call's, when
    each request arrives (the call's deadline is each request's: one that the deadline
    ends counts as `deadline`, not `cancelled`)."""
    responses: asyncio.Queue[Queued | None] = asyncio.Queue(QUEUED_RESPONSES)
    window = asyncio.Semaphore(STREAM_WINDOW)
    budget = stream_budget(service.max_response_bytes())

    async def put(response: pb.ModelStreamInferResponse, stream: StepStream | None = None) -> None:
        """Queue a response; its bytes are held in the budget until the client took it
        (`stream`: a step's output's, held since it came, its sequence's to settle)."""
        if stream is None:
            size = _size(response)
            budget.hold(size)
            budget.largest = max(budget.largest, size)
            await responses.put((response, functools.partial(budget.give, size)))
        else:
            await responses.put((response, functools.partial(stream.taken, stream.last_bytes)))

    async def one(msg: pb.ModelInferRequest | Undecodable, cfg: ModelConfig | None,
                  answer: int) -> None:  # fmt: skip
        # a step-wise request's: it holds the window read() reserved, till its caller took
        # its outputs (or at once, if it never starts)
        stream = (
            StepStream(budget=budget, handed_on=True, reserved=True) if _steps_of(cfg) else None
        )
        try:
            await _answer(service, msg, cfg, put, carrier, time_remaining(), stream)
        finally:
            window.release()
            budget.answered(answer)  # (its answer, if any, is held now)
            if stream is not None:
                stream.close()

    ended: list[BaseException] = []  # what ended the request stream, if not its end

    async def read() -> None:
        async with asyncio.TaskGroup() as tg:
            try:
                async for msg in requests:
                    await window.acquire()
                    cfg = None if isinstance(msg, Undecodable) else service.served(msg)
                    # its caller is behind, the sequences' windows hold their half, or
                    # the answers coming would: let it read first
                    answer = answer_bytes(msg, cfg, budget.largest)
                    await budget.room(sequence=_steps_of(cfg), answer=answer)
                    tg.create_task(one(msg, cfg, answer))
            except Exception as e:  # the requests' stream failed: those in flight are
                ended.append(e)  # still answered, then the call ends with its error
        await responses.put(None)

    reader = asyncio.create_task(read())
    try:
        while (out := await responses.get()) is not None:
            yield out[0]
            budget.took(_size(out[0]))  # its caller reads (a sequence's stall timer; not
            # ByteSize(), which serialized each response a second time: 57e)
            out[1]()  # gRPC took it
        await reader
        if ended:
            raise ended[0]
    finally:
        reader.cancel()


async def _answer(service: Answers, msg: pb.ModelInferRequest | Undecodable,
                  cfg: ModelConfig | None, put: Put, carrier: Any, time_remaining: float | None,
                  stream: StepStream | None) -> None:  # fmt: skip
    """One request of the stream, answered: its responses, or its failure's."""
    try:
        if isinstance(msg, Undecodable):
            raise msg.error
        _check(msg)
        now = service.served(msg)  # (no await from here to the version's own lookup)
        if now is not None and _steps_of(now) != _steps_of(cfg):  # (unloaded: NOT_FOUND)
            kind = "a step-wise" if _steps_of(now) else "a one-shot"
            raise Unavailable(f"model {clip(msg.model_name)} was loaded or reloaded as {kind} "
                              "model while this request was read; send it again")  # fmt: skip
        if cfg is not None and stream is not None:
            await _steps(service, msg, cfg, put, carrier, time_remaining, stream)
        else:
            response = await service.infer(msg, time_remaining, carrier)
            await put(_final(response, True), None)
    except BatchdError as e:
        await put(_error(msg, e, cfg), None)
    except Exception:  # a defect: this request fails, the stream's others go on
        log.exception("a ModelStreamInfer request failed")
        await put(_error(msg, BatchdError("internal error"), cfg), None)


async def write_all(
    context: grpc.aio.ServicerContext, responses: AsyncGenerator[pb.ModelStreamInferResponse]
) -> None:
    """Each response written to the call, until one cannot be: its caller left, or its
    deadline passed, while it waited for room (gRPC's flow control). Yielded to gRPC
    instead, such a write logged an ERROR with a traceback (ExecuteBatchError) for every
    caller that went. The headers go first, alone: with the first response's write
    failed, gRPC sent them again with the status, and logged
    GRPC_CALL_ERROR_TOO_MANY_OPERATIONS. A write (or the headers) refused ends the call
    as cancelled, which gRPC ends quietly; one that returned had gRPC send the status,
    and the headers not sent yet with it, into the call the core had ended (57a, 57d)."""
    async with contextlib.aclosing(responses):
        await _sent(context.send_initial_metadata(()))
        async for response in responses:
            await _sent(context.write(response))


async def _sent(sending: Awaitable[None]) -> None:
    """`sending` done; CancelledError if the core refused it: the call is over."""
    try:
        await sending
    except Exception as e:
        if type(e).__name__ != "ExecuteBatchError":
            raise
        log.debug("a ModelStreamInfer caller left with responses unsent")
        raise asyncio.CancelledError("its caller left") from None


def answer_bytes(msg: pb.ModelInferRequest | Undecodable, cfg: ModelConfig | None,
                 unknown: int) -> int:  # fmt: skip
    """The bytes a stream promises a one-shot request's answer when it reads it: its
    outputs' where the model's signature fixes them (its rows, at most max_batch_size,
    times each output asked for), else `unknown` (the largest answer of the stream yet).
    Nothing for a step-wise request (its window is its promise), nor for one refused
    (its answer is an error)."""
    if isinstance(msg, Undecodable) or cfg is None or cfg.generate is not None:
        return 0
    rows = 1
    if cfg.max_batch_size:
        if not msg.inputs or not msg.inputs[0].shape:
            return 0  # (refused)
        rows = min(max(msg.inputs[0].shape[0], 0), cfg.max_batch_size)
    asked = dict.fromkeys(o.name for o in msg.outputs) or cfg.output_names
    total, whole = fixed_output_bytes(cfg, asked, rows)
    return total if whole else unknown  # (not: BYTES, or a dim the model decides)


def _steps_of(cfg: ModelConfig | None) -> bool:
    return cfg is not None and cfg.generate is not None


def _check(msg: pb.ModelInferRequest) -> None:
    """Refuse what the stream reads of a request itself, as the codec refuses the rest."""
    if EMPTY_FINAL not in msg.parameters:
        return
    kind = msg.parameters[EMPTY_FINAL].WhichOneof("parameter_choice")
    if kind != "bool_param":  # (a string "true" was read as false, silently)
        raise InvalidInput(f"parameter {EMPTY_FINAL!r}: expected a boolean, got {kind}")


def _error(msg: pb.ModelInferRequest | Undecodable, e: BatchdError,
           cfg: ModelConfig | None) -> pb.ModelStreamInferResponse:  # fmt: skip
    """A failed request's response: its error, and where it parsed its id, model and
    version (the one asked for, else the one serving it); always the request's final
    response. Triton's StreamInferResponseComplete sets these on a request that fails
    once issued, the flag whether or not it asked for empty final responses (one it
    refuses before, it answers with the id alone); here every failure ends its
    request, so every one says so."""
    error = pb.ModelInferResponse()
    if not isinstance(msg, Undecodable):
        # (an id refused for its length is not echoed: a stream that did not read held each)
        error.model_name, error.id = msg.model_name[:200], msg.id if echoable(msg.id) else ""
        error.model_version = msg.model_version[:200] or (cfg.version if cfg else "")
    error.parameters["error_code"].string_param = e.code.name  # for typed errors
    if e.retry_after_ms is not None:  # as a unary call's trailer says
        error.parameters["retry_pushback_ms"].int64_param = e.retry_after_ms
    error.parameters[FINAL].bool_param = True
    return pb.ModelStreamInferResponse(error_message=e.message, infer_response=error)
